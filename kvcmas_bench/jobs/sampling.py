"""Which samples a run measures and how a finished sample is recorded, shared by both engines'
``run`` paths (:mod:`.run` in-process, :mod:`.served` on vLLM): the seeded subset with its held-out
calibration and warm-up sets, the model checks made from its config before any weights load, and
the sample record. ``opts``: a run's options (:class:`~.run.RunOptions`)."""

from __future__ import annotations

import random

from ..errors import BenchError
from ..methods import MethodSpec
from ..results.records import RunDir, write_json
from ..results.request import RequestRecord
from ..results.summary import summarize
from ..workflow import plan
from ..workloads import Workload


def select_samples(samples: list, limit: int | None, seed: int) -> list:
    """A seeded shuffle, then the first ``limit``: the same seed gives the same subset."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    if limit is not None:
        order = order[:limit]
    return [samples[i] for i in order]


def calibration_samples(samples: list, evaluated: set[str], n: int, seed: int) -> list:
    """``n`` samples disjoint from the evaluated ones, from the far end of the seeded order."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    picked = [samples[i] for i in reversed(order) if samples[i].id not in evaluated]
    return picked[:n]


def check_model(opts, workload: Workload, spec: MethodSpec, config) -> None:
    """What depends on the model, checked from its config before the weights load: the method's
    knobs against its layer count (:meth:`Method.check_model`) and the workflow against its
    context (:func:`check_context`)."""
    text = getattr(config, "text_config", None) or config
    n_layers = getattr(text, "num_hidden_layers", None)
    if isinstance(n_layers, int):
        spec().check_model(n_layers)
    check_context(opts, workload, config)


def check_context(opts, workload: Workload, config) -> None:
    """The agent outputs one prompt of the workflow accumulates, plus the agent's own output, must fit
    the model's context (``max_position_embeddings`` of its ``config``); the prompt text comes on top."""
    limit = getattr(getattr(config, "text_config", config), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    n_agents = opts.agents or len(workload.roles) + 1
    max_new = opts.max_new_tokens or workload.max_new_tokens
    final_new = opts.final_max_new_tokens or workload.final_max_new_tokens
    nodes = plan(opts.topology, workload.roles, workload.final_role, n_agents, opts.rounds)
    need = max(len(n.reads) * max_new + (final_new if n.final else max_new) for n in nodes)
    if need > limit:
        raise BenchError(
            f"--agents {n_agents} --rounds {opts.rounds} ({opts.topology}): one prompt accumulates agent outputs "
            f"and an answer of up to {need} tokens > the model's context of {limit}; lower --agents, --rounds "
            "or --max-new-tokens"
        )


def pick_samples(opts, workload: Workload, spec: MethodSpec) -> tuple[list, list, list]:
    """The measured samples (a seeded subset), then the held-out calibration and warm-up ones."""
    all_samples = workload.load()
    samples = select_samples(all_samples, opts.limit, opts.seed)
    if not samples:
        raise BenchError("no samples selected (check --subjects / --data-path)")
    calib: list = []
    if spec.cls.needs_calibration or getattr(opts, "target_reuse", None) is not None:
        calib = calibration_samples(all_samples, {s.id for s in samples}, opts.calib_samples, opts.seed)
        if not calib:
            raise BenchError("no calibration samples left outside the evaluated ones; lower --limit")
    warm = calibration_samples(all_samples, {s.id for s in samples + calib}, opts.warmup, opts.seed)
    if len(warm) < opts.warmup:
        raise BenchError(
            f"--warmup {opts.warmup}: only {len(warm)} samples left outside the evaluated and calibration ones; "
            "lower --warmup or --limit"
        )
    return samples, calib, warm


def throughput(n: int, wall_s: float) -> dict:
    """Samples run by this invocation and their wall time (a resumed run counts its own samples only)."""
    return {"samples_run": n, "wall_s": round(wall_s, 3), "samples_per_s": n / wall_s if n and wall_s > 0 else None}


def sample_record(workload: Workload, sample, final_text: str, reqs: list[RequestRecord]) -> dict:
    """A sample's record: its final agent's answer scored, the sum of its requests' latencies and
    their mean TTFT."""
    pred, correct = workload.score(sample, final_text)
    return {
        "sample_id": sample.id,
        "gold": sample.gold,
        "prediction": pred,
        "correct": bool(correct),
        "latency_s": sum(r.e2e_s for r in reqs),
        "ttft_s": sum(r.ttft_s for r in reqs) / len(reqs),
        "final_output": final_text,
        "meta": sample.meta,
    }


def config_keys(opts, method, flow, samples: list, calib: list, warm: list) -> dict:
    """What a run's ``config.json`` says of its method, workload, budgets, workflow and samples, on
    either engine (each adds its model, device and engine keys)."""
    return {
        "method": opts.method,
        "method_config": method.config(),
        "workload": opts.workload,
        "dtype": opts.dtype,
        "seed": opts.seed,
        "limit": opts.limit,
        "subjects": opts.subjects,
        "data_path": opts.data_path,
        "max_new_tokens": flow.max_new,
        "final_max_new_tokens": flow.final_max_new,
        "topology": opts.topology,
        "n_agents": flow.n_agents,
        "rounds": opts.rounds,
        "sample_ids": [s.id for s in samples],
        "calibration_samples": [s.id for s in calib],
        "warmup_samples": [s.id for s in warm] or None,
        "agents": [r.name for r, _ in flow.agents()],
        "decoding": "greedy",
    }


def note(progress, message: str) -> None:
    """One line about the run above its progress bar (when the display takes notes)."""
    if progress is not None and hasattr(progress, "note"):
        progress.note(message)


def begin(progress, opts, samples: list, todo: list, out: RunDir) -> None:
    """Start the progress display over ``samples`` with the finished ones counted (their accuracy
    too), saying first when ``--limit`` is unset and the whole dataset will run."""
    if opts.limit is None:
        note(
            progress,
            f"--limit not set: all {len(samples)} samples of {opts.workload}, {len(todo)} left to run "
            "(the bar estimates the time after the first); pass --limit N for a seeded subset",
        )
    if progress is not None:
        progress.start(total=len(samples), done=len(samples) - len(todo))
        if hasattr(progress, "resumed"):  # the finished samples count in the accuracy shown
            progress.resumed(out.samples)


def finish(out: RunDir, samples: list, meta: dict, engine: dict) -> dict:
    """The run's summary over its own samples (a directory may hold others from a larger
    ``--limit``), with ``engine`` (name, concurrency, :func:`throughput`), written and returned."""
    wanted = {s.id for s in samples}
    summary = summarize(
        [s for s in out.samples if s["sample_id"] in wanted], [r for r in out.requests if r.sample_id in wanted], meta
    )
    summary["engine"] = engine
    write_json(out.summary_path, summary)
    return summary
