"""``run --engine vllm``: the ``run`` job with a vLLM deployment executing the agents.

The same samples (seeded subset, calibration and warm-up sets), prompts, token budgets, scoring and
records as the in-process ``run`` (:mod:`.run`); the agents' requests go to ``vllm serve`` with
KVCMASConnector (started here, or ``--engine-arg base_url=URL``), ``--max-concurrency`` samples in
flight at once (:mod:`kvcmas_bench.serving.vllm.samples`). What differs, by design:

- the method runs in the server's worker, in one session for the whole run: online state (anchors)
  is updated as requests finish there, so with more than one sample in flight the order in which
  samples see each other's anchors depends on timing (docs/serving-vllm.md, "Accuracy runs");
- the session ends with the process, so a resumed run starts the method state afresh (warm-up, when
  asked, runs again) and counts on from the saved samples;
- ``--fidelity`` and ``--target-reuse`` are refused (they need the in-process engine's dense
  reference prefills), as are the vision workloads (vLLM gets token ids only here).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from ..errors import BenchError
from ..methods import MethodSpec
from ..results.provenance import provenance
from ..results.records import RunDir
from ..settings import EvalSettings
from ..workflow import Workflow
from ..workloads import Workload
from .sampling import begin, check_model, config_keys, finish, note, pick_samples, sample_record, throughput

#: what ``config.json`` says ran the samples (a resume key: a run continues on the engine it began on)
ENGINE_LABEL = "vllm server (vllm serve + KVCMASConnector, samples batched by vLLM)"


def check_served(opts: EvalSettings, workload: Workload, specs: dict[str, MethodSpec]) -> None:
    """What ``--engine vllm`` cannot do with ``workload`` and the methods of ``specs``, refused with
    one line before anything starts (``run``, every cell of ``suite`` and ``ablate``)."""
    from ..serving.engines import check_engine
    from ..serving.vllm import INSTALL_HINT, available
    from ..serving.vllm.http import ServerOptions

    check_engine("vllm", specs)
    if workload.modality != "text":
        raise BenchError(
            f"--engine vllm runs text workloads; {opts.workload} sends images or video, which the connector's "
            "token-id requests do not carry: use --engine in-process"
        )
    if opts.fidelity:
        raise BenchError(
            "--fidelity needs --engine in-process: it compares each reused segment with a dense prefill of the "
            "same prompt, which the vLLM engine does not capture (the in-process engine measures it exactly)"
        )
    if getattr(opts, "target_reuse", None) is not None:
        raise BenchError("--target-reuse needs --engine in-process (tau is picked on in-process calibration runs)")
    server = ServerOptions.parse(dict(opts.engine_args))  # bad engine options fail before the output path is touched
    if not (server.base_url or server.vllm_bin or available() or shutil.which("vllm")):
        raise BenchError(INSTALL_HINT)


@contextmanager
def one_server(opts: EvalSettings, start: bool = True) -> Iterator[None]:
    """The cells of a suite or ablation on ``--engine vllm`` share one server: started here for all
    of them (each cell's client gets its ``base_url``), unless ``--engine-arg base_url`` names one
    or nothing is left to run (``start`` False)."""
    if opts.engine != "vllm" or opts.engine_args.get("base_url") or not start:
        yield
        return
    from ..serving import get_engine

    engine = get_engine(
        "vllm", model=opts.model, device=opts.device, dtype=opts.dtype, ignore_eos=False, warmup=False,
        **opts.engine_args,
    )  # fmt: skip
    given = opts.engine_args
    opts.engine_args = {**given, "base_url": engine.base_url}
    try:
        yield
    finally:
        opts.engine_args = given
        engine.close()


def run_served(opts, workload: Workload, spec: MethodSpec, progress=None) -> dict:
    """Run (or resume) one benchmark on a vLLM deployment and return its summary (``opts``: a
    :class:`~.run.RunOptions`, checked into ``workload`` and ``spec`` by ``run``)."""
    from ..serving import get_engine
    from ..serving.vllm.samples import SampleClient

    samples, calib, warm = pick_samples(opts, workload, spec)
    engine = get_engine(
        "vllm", model=opts.model, device=opts.device, dtype=opts.dtype, ignore_eos=False, warmup=True,
        **opts.engine_args,
    )  # fmt: skip
    try:
        check_model(opts, workload, spec, engine.config)
        flow = sample_flow(opts, workload, engine.tokenizer)
        client = SampleClient(engine, flow, spec)
        out = RunDir(opts.output_path, served_config(opts, engine, client, flow, samples, calib, warm))
        out.repair()
        if calib:
            client.calibrate(calib)
        if warm:
            note(progress, f"warm-up: {len(warm)} held-out samples through the method first")
            client.warm_up(warm)
        todo = [s for s in samples if s.id not in out.done_ids]
        if out.samples and client.method.learns_online:
            note(progress, f"resumed: {len(out.samples)} samples saved; the method's server state starts afresh")
        begin(progress, opts, samples, todo, out)
        t0, n_run = time.perf_counter(), 0
        for served in client.run(todo, opts.max_concurrency):
            sample_rec, reqs, prompts = served_records(flow, served, engine.tokenizer)
            out.append(sample_rec, reqs)  # the commit point
            if opts.log_prompts:
                out.log_prompts(prompts)
            n_run += 1
            if progress is not None:
                progress.advance(sample_rec)
        wall = time.perf_counter() - t0
        client.end()
    finally:
        engine.close()
    meta = {
        "method": opts.method,
        "workload": opts.workload,
        "model": engine.model_name,
        "device": engine_device(engine),
    }
    return finish(
        out, samples, meta, {"name": "vllm", "max_concurrency": opts.max_concurrency, **throughput(n_run, wall)}
    )


def sample_flow(opts, workload: Workload, tokenizer) -> Workflow:
    """The run's agent graph and prompt rendering (the in-process ``run``'s :class:`Workflow`, with
    the tokenizer only: vLLM executes the requests)."""
    return Workflow(
        SimpleNamespace(tokenizer=tokenizer),
        None,
        workload,
        opts.max_new_tokens,
        opts.final_max_new_tokens,
        topology=opts.topology,
        agents=opts.agents,
        rounds=opts.rounds,
    )


def engine_device(engine) -> str:
    return "cpu" if engine.cpu else "cuda"


def served_records(flow: Workflow, served, tokenizer) -> tuple[dict, list, list[dict]]:
    """The sample record, request records and rendered prompts of one served sample: the worker's
    records (their layer count the served model's) with the sample's keys, each agent's role and
    decoded output (as the in-process ``run``)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    sample = served.sample
    reqs, prompts = [], []
    for s, rec in zip(served.sent, served.records):
        node = flow.nodes[s.index]
        rec.sample_id, rec.trajectory, rec.qps = sample.id, None, None
        rec.step, rec.node, rec.agent = s.index, node.id, node.role.name
        rec.output = decode(s.output)
        reqs.append(rec)
        prompt = decode(s.prompt)
        prompts.append({"sample_id": sample.id, "step": s.index, "node": node.id, "agent": rec.agent, "prompt": prompt})
    if len(reqs) != len(flow.nodes):
        raise BenchError(f"sample {sample.id}: the server ran {len(reqs)} of its {len(flow.nodes)} agents")
    final = reqs[-1].output or ""
    return sample_record(flow.workload, sample, final, reqs), reqs, prompts


def served_config(opts, engine, client, flow: Workflow, samples, calib, warm) -> dict:
    """``config.json`` of a run on the vLLM engine: the in-process run's keys (so report, compare and
    resume read it alike) with the engine's own description."""
    method = client.method
    device = torch.device(engine_device(engine))
    return {
        **config_keys(opts, method, flow, samples, calib, warm),
        "method_resolved": method.resolved(device, engine.kv_width),
        "model": engine.model_name,
        "model_source": engine.model_source,
        "device": str(device),
        "fidelity": False,
        "target_reuse": None,
        "auto_tau": None,
        "prefix_caching": bool(engine.opts.prefix_caching),
        "engine": ENGINE_LABEL,
        "max_concurrency": opts.max_concurrency,
        "engine_options": {k: v for k, v in engine.describe().items() if k not in ("worker_reports", "calibrations")},
        "peak_memory": "per request: the vLLM worker process's peak RSS (CPU) as the worker records it",
        **provenance(device),
    }
