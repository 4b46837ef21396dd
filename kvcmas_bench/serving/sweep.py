"""The ``serve-sweep`` job: measure each method once per shared length, then sweep QPS on a
virtual clock.

For every shared-context length the controlled traces (:mod:`.traces`) are built once (or loaded)
and every method runs each evaluated trajectory's four requests for real, in isolation, on the
backend (default: the in-process engine). Those measured service times are then replayed on a
one-request-at-a-time FCFS server (:mod:`.queueing`) under the trajectory arrivals of every QPS
value (:mod:`.arrivals`; the same seeded arrival pattern, scaled by 1/qps, for every method).
QPS counts trajectory starts per second; agent ``j + 1`` arrives when agent ``j`` completes; QPS 0
is single stream.

Output directory: ``config.json``, ``traces.jsonl`` (replayable), ``service.jsonl`` (one measured
request a line), ``requests.jsonl`` (one served request per method/shared/qps a line, with its
timeline), ``summary.json`` (one row per method/shared/qps) and the TTFT plots. Measuring resumes:
(method, shared length) pairs already in ``service.jsonl`` are not measured again when the
measurement settings match; :func:`evaluate_service` re-sweeps saved measurements without a model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import BenchError
from ..results.records import write_json
from .arrivals import arrival_times, check_rate
from .queueing import SERVER_MODEL, Served, ServiceRecord, simulate
from .traces import DEFAULT_ACCUMULATED_CONTEXT, N_AGENTS, Trace, build_traces, load_traces, save_traces

PERCENTILES = (50, 90, 99)
DEFINITIONS = {
    "ttft_pXX_s": "numpy.percentile (linear) over all agent requests of first-token time - arrival, under load",
    "e2e_pXX_s": "completion - arrival, under load",
    "service_ttft_mean_s / service_e2e_mean_s": "measured in isolation (engine ttft_s / e2e_s; TTFT includes "
                                               "correction and reference-prefill work)",
    "trajectory_service_mean_s": "sum of the 4 agents' measured E2E, mean over trajectories",
    "utilization": "offered load = qps x trajectory_service_mean_s (None for single stream); >= 1 saturates",
    "busy_fraction": "total service time / makespan",
    "makespan_s": "last completion - first arrival on the virtual clock",
    "throughput_req_s / throughput_tok_s": "agent requests / generated tokens per second of makespan",
    "peak_mem_bytes": "max over requests of the device peak (CUDA) or process peak RSS; the peak is reset "
                      "before each method's measured trajectories where the OS allows (see backend_config)",
    "kv_state_peak_bytes": "max over requests of request KV + the trajectory's shared-segment store + "
                           "method.state_bytes() (anchor pools, references, calibration tables)",
    "reuse_ratio": "kvcmas_bench.results.summary.reuse_ratio over the measured requests",
}
QPS_UNIT = "trajectory starts per second (each trajectory = 4 dependent agent requests)"
# settings that change measured service times: a resumed output directory must match them
MEASURE_KEYS = ("model", "dtype", "device", "backend", "method_args", "traces_sha256", "ignore_eos", "warmup")


def percentile(values: Sequence[float], q: float) -> float | None:
    """``numpy.percentile`` (linear interpolation) of ``values``; None when empty."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


# ---- validation -----------------------------------------------------------------------------------
def resolve_methods(methods: Sequence[str]) -> list[str]:
    from ..methods import METHODS

    if not methods:
        raise BenchError("no methods given (use a comma-separated list or 'all')")
    out: list[str] = []
    first = [n for n in ("nonshared", "fullshared") if n in METHODS]
    every = first + [n for n in METHODS if n not in first and not n.startswith("_")]
    for m in methods:
        names = every if m == "all" else [m]
        for n in names:
            if n not in METHODS:
                raise BenchError(f"unknown method {n!r}; available: {', '.join(sorted(METHODS))}, all")
            if n not in out:
                out.append(n)
    return out


def validate(methods: Sequence[str], qps: Sequence[float], shared_tokens: Sequence[int], num_trajectories: int,
             burstiness: float, output_tokens: int, calib_trajectories: int,
             from_file: bool) -> tuple[list[str], list[float]]:
    names = resolve_methods(methods)
    if not qps:
        raise BenchError("no QPS values given (0 = single stream)")
    for q in qps:
        check_rate(float(q), burstiness)
    check_rate(0.0, burstiness)
    if not from_file and not shared_tokens:
        raise BenchError("no shared-context lengths given")
    for s in shared_tokens:
        if int(s) != s or s < 1:
            raise BenchError(f"--shared-tokens values must be positive integers, got {s}")
    if int(num_trajectories) != num_trajectories or num_trajectories < 1:
        raise BenchError(f"--trajectories must be a positive integer, got {num_trajectories}")
    if int(output_tokens) != output_tokens or output_tokens < 1:
        raise BenchError(f"--output-tokens must be a positive integer, got {output_tokens}")
    if calib_trajectories < 0:
        raise BenchError(f"calibration trajectories must be >= 0, got {calib_trajectories}")
    return names, sorted({float(q) for q in qps})


def check_fits(traces: Sequence[Trace], max_positions: int | None, vocab: int | None) -> None:
    """Every agent's prompt + output must fit the model context; every id the vocabulary."""
    for tr in traces:
        need = tr.max_positions()
        if max_positions is not None and need > max_positions:
            what = (f"accumulated output of {tr.shared_tokens} tokens" if tr.accumulated
                    else f"shared context of {tr.shared_tokens} tokens")
            raise BenchError(f"{what} does not fit the model: the {len(tr.agents)} agents' prompts + "
                             f"outputs reach {need} positions > max_position_embeddings {max_positions}; "
                             "lower --shared-tokens or --output-tokens")
        if vocab is not None:
            top = max([max(tr.context_ids, default=0)] +
                      [max(s["ids"], default=0) for a in tr.agents for s in a.segments if s["kind"] == "PF"])
            if top >= vocab:
                raise BenchError(f"trace {tr.id} holds token id {top} >= vocabulary size {vocab} "
                                 "(built with another tokenizer?)")


# ---- metrics ----------------------------------------------------------------------------------------
def served_metrics(served: list[Served], service: list[list[ServiceRecord]], qps: float) -> dict:
    """TTFT/E2E percentiles under load, throughput on the virtual clock, offered load."""
    ttft = [s.ttft_s for s in served]
    e2e = [s.e2e_s for s in served]
    makespan = max(s.completion_s for s in served) - min(s.arrival_s for s in served)
    out_tok = sum(r.output_tokens for tr in service for r in tr)
    traj_service = [sum(r.service_s for r in tr) for tr in service]
    busy = sum(traj_service)
    row = {"n_trajectories": len(service), "n_requests": len(served)}
    for name, vals in (("ttft", ttft), ("e2e", e2e)):
        for q in PERCENTILES:
            row[f"{name}_p{q}_s"] = percentile(vals, q)
        row[f"{name}_mean_s"] = float(np.mean(vals))
    row["queue_mean_s"] = float(np.mean([s.queue_s for s in served]))
    row["service_ttft_mean_s"] = float(np.mean([r.prefill_s for tr in service for r in tr]))
    row["service_e2e_mean_s"] = float(np.mean([r.service_s for tr in service for r in tr]))
    row["trajectory_service_mean_s"] = float(np.mean(traj_service))
    row["makespan_s"] = makespan
    row["throughput_req_s"] = len(served) / makespan if makespan > 0 else None
    row["throughput_tok_s"] = out_tok / makespan if makespan > 0 else None
    row["busy_fraction"] = busy / makespan if makespan > 0 else None
    # offered load of the open-loop arrivals; single stream (qps 0) has none
    row["utilization"] = qps * float(np.mean(traj_service)) if qps > 0 else None
    row["saturated"] = bool(row["utilization"] is not None and row["utilization"] >= 1.0)
    return row


def service_metrics(service: list[list[ServiceRecord]]) -> dict:
    """Load-independent figures of one (method, shared) measurement: memory, reuse."""
    import pandas as pd

    from ..results.summary import reuse_ratio

    recs = [r for tr in service for r in tr]
    peaks = [r.device_peak_bytes if r.device_peak_bytes is not None else r.peak_rss_bytes for r in recs]
    peaks = [p for p in peaks if p is not None]
    df = pd.DataFrame([r.to_dict() for r in recs])
    return {
        "peak_mem_bytes": max(peaks) if peaks else None,
        "peak_mem_kind": "device" if recs and recs[0].device_peak_bytes is not None else "rss",
        "kv_state_peak_bytes": max(r.kv_state_bytes for r in recs),
        "method_state_peak_bytes": max(r.method_state_bytes for r in recs),
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in recs])),
        "output_tokens_mean": float(np.mean([r.output_tokens for r in recs])),
        "prefilled_tokens": int(sum(r.prefilled_tokens for r in recs)),
        "reused_tokens": int(sum(r.reused_tokens for r in recs)),
        "reference_tokens": int(sum(r.reference_tokens for r in recs)),
        "reuse_ratio": reuse_ratio(df),
    }


def evaluate(measured: dict[tuple[str, int], list[list[ServiceRecord]]], qps: Sequence[float],
             burstiness: float = 1.0, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Replay every measurement at every QPS. Returns (summary rows, served-request records)."""
    rows: list[dict] = []
    requests: list[dict] = []
    for (method, shared), service in measured.items():
        base = service_metrics(service)
        pairs = [[(r.prefill_s, r.service_s) for r in tr] for tr in service]
        for q in qps:
            arr = arrival_times(len(service), q, burstiness, seed)
            served = simulate(pairs, None if arr is None else list(arr))
            rows.append({"method": method, "shared_tokens": shared, "qps": q,
                         **served_metrics(served, service, q), **base})
            for s in served:
                r = service[s.trajectory][s.agent_index]
                requests.append({
                    "method": method, "shared_tokens": shared, "qps": q, "trajectory": r.trajectory,
                    "agent_index": s.agent_index, "agent": r.agent, "arrival_s": s.arrival_s,
                    "start_s": s.start_s, "first_token_s": s.first_token_s, "completion_s": s.completion_s,
                    "queue_s": s.queue_s, "ttft_s": s.ttft_s, "e2e_s": s.e2e_s,
                    "service_ttft_s": r.prefill_s, "service_e2e_s": r.service_s,
                    "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens})
    return rows, requests


# ---- output directory -----------------------------------------------------------------------------
def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
    tmp.replace(path)


def _read_service(path: Path) -> dict[tuple[str, int], list[list[ServiceRecord]]]:
    """Saved measurements, grouped (method, shared) -> trajectories -> agents; torn lines dropped."""
    groups: dict[tuple[str, int], dict[str, list[ServiceRecord]]] = {}
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                break
            rec = ServiceRecord.from_dict(d)
            groups.setdefault((d["method"], int(d["shared_tokens"])), {}).setdefault(rec.trajectory, []).append(rec)
    return {k: [sorted(v, key=lambda r: r.agent_index) for v in trajs.values()] for k, trajs in groups.items()}


def _append_service(path: Path, method: str, shared: int, service: list[list[ServiceRecord]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for tr in service:
            for r in tr:
                f.write(json.dumps({"method": method, "shared_tokens": shared, **r.to_dict()}, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def finish(out_dir: Path, config: dict, measured: dict, qps: Sequence[float], burstiness: float, seed: int,
           plots: bool = True, console=None) -> dict:
    """Sweep QPS over the measurements; write requests.jsonl, summary.json, plots; print the table."""
    rows, requests = evaluate(measured, qps, burstiness, seed)
    _write_jsonl(out_dir / "requests.jsonl", requests)
    summary = {"server": SERVER_MODEL, "qps_unit": QPS_UNIT, "qps": list(qps), "burstiness": burstiness,
               "seed": seed, "model": config.get("model"), "device": config.get("device"),
               "accumulated": config.get("accumulated"), "definitions": DEFINITIONS, "rows": rows, "plots": []}
    if plots:
        from .plots import plot_all

        summary["plots"] = [p.name for p in plot_all(rows, out_dir, bool(config.get("accumulated")))]
    write_json(out_dir / "summary.json", summary)
    if console is not None:
        print_table(summary, console)
    return summary


def _fmt(v, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "B":
        return f"{v / 2**20:.1f} MiB"
    if unit == "s":
        return f"{v:.3f}"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def print_table(summary: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"serve-sweep ({summary.get('model')}; server: one request at a time, FCFS; "
                    "QPS = trajectories/s, 0 = single stream)")
    for col in ("method", "shared", "qps", "util", "TTFT p50 (s)", "p90", "p99", "mean", "tok/s",
                "peak mem", "KV+state", "rho"):
        t.add_column(col, justify="right" if col != "method" else "left", no_wrap=col == "method")
    for r in summary["rows"]:
        t.add_row(r["method"], str(r["shared_tokens"]), _fmt(r["qps"]), _fmt(r["utilization"]),
                  _fmt(r["ttft_p50_s"], "s"), _fmt(r["ttft_p90_s"], "s"), _fmt(r["ttft_p99_s"], "s"),
                  _fmt(r["ttft_mean_s"], "s"), _fmt(r["throughput_tok_s"]),
                  _fmt(r["peak_mem_bytes"], "B"), _fmt(r["kv_state_peak_bytes"], "B"), _fmt(r["reuse_ratio"]))
    console.print(t)


def config_device(backend) -> str:
    return str(backend.describe().get("device", "cpu"))


def _hardware(device: str) -> dict:
    import torch

    from ..runner import hardware

    try:
        return hardware(torch.device(device))
    except (RuntimeError, AssertionError):
        return hardware(torch.device("cpu"))


def _load(model, device: str, dtype: str):
    """``model``: None/str spec for :func:`load_model`, or an already loaded object with
    ``.model`` and ``.tokenizer`` (e.g. a LoadedModel; tests pass a tiny model this way)."""
    if model is not None and not isinstance(model, str):
        return model
    from ..modeling import load_model, resolve_device, resolve_dtype

    resolve_dtype(dtype)
    return load_model(model, dtype, str(resolve_device(device)))


def serve_sweep(methods: list[str], qps: list[float], shared_tokens: list[int], num_trajectories: int,
                output_path: str, model=None, device: str = "auto", dtype: str = "float32", seed: int = 0,
                burstiness: float = 1.0, output_tokens: int = 128, accumulated: bool = False,
                traces_path: str | None = None, *, context_tokens: int = DEFAULT_ACCUMULATED_CONTEXT,
                calib_trajectories: int = 2, method_args: dict | None = None, ignore_eos: bool = True,
                warmup: bool = True, plots: bool = True, console=None, show_table: bool = True,
                progress: Callable[[str], None] | None = None, texts=None, backend=None) -> dict:
    """Measure every method once per shared length, replay all QPS values, write the results.

    ``methods``: names or ``["all"]``; ``qps``: trajectory starts per second, 0 = single stream;
    ``shared_tokens``: non-generated shared context lengths (``accumulated=True``: accumulated
    agent-output lengths over ``context_tokens`` of context, ``// 3`` generated per agent);
    ``traces_path``: replay a saved ``traces.jsonl`` instead of building traces (its lengths are
    selected by ``shared_tokens``; an empty list takes all). ``model``: None/spec string for
    :func:`~kvcmas_bench.modeling.load_model`, or a loaded object with ``.model``/``.tokenizer``.
    ``method_args``: overrides such as ``{"tau": .., "rank": .., "anchors": .., "rho": ..}`` (None
    values and keys a method lacks are ignored). ``console``: rich Console for the table (default
    stdout); ``progress``: callback for one-line progress messages; ``backend``: a
    :class:`~.queueing.Backend` to measure with instead of the in-process engine (then ``model``,
    ``device``, ``dtype``, ``ignore_eos`` and ``warmup`` are the backend's business). Returns the summary dict (also
    written to ``output_path/summary.json``). Raises :class:`BenchError` on bad input.
    """
    from rich.console import Console

    names, qps_list = validate(methods, qps, shared_tokens, num_trajectories, burstiness, output_tokens,
                               calib_trajectories, traces_path is not None)
    from ..methods import METHODS

    needs_calib = [n for n in names if METHODS[n].needs_calibration]
    if needs_calib and calib_trajectories < 1 and traces_path is None:
        raise BenchError(f"{', '.join(needs_calib)} need calibration trajectories (calib_trajectories >= 1)")
    console = console if console is not None else Console()
    say = progress or (lambda msg: console.print(f"[dim]{msg}[/dim]"))
    out_dir = Path(output_path)
    if out_dir.exists() and not out_dir.is_dir():
        raise BenchError(f"--output-path {out_dir} exists and is not a directory")
    loaded_traces = load_traces(traces_path) if traces_path else None
    model_name = model_source = None
    if backend is None:
        lm = _load(model, device, dtype)
        from .backends import InProcessBackend

        backend = InProcessBackend(lm.model, lm.tokenizer, ignore_eos=ignore_eos, warmup=warmup)
        model_name, model_source = getattr(lm, "name", None), getattr(lm, "source", None)
    max_pos, vocab = backend.max_positions, backend.vocab_size

    # traces, grouped by shared length: (eval, calibration)
    groups: dict[int, tuple[list[Trace], list[Trace]]] = {}
    if loaded_traces is not None:
        kinds = {t.accumulated for t in loaded_traces}
        if kinds != {accumulated}:
            raise BenchError(f"{traces_path} holds {'accumulated' if True in kinds else 'controlled'} traces "
                             f"but accumulated={accumulated} was asked")
        lengths = sorted({t.shared_tokens for t in loaded_traces})
        wanted = list(dict.fromkeys(int(s) for s in shared_tokens)) or lengths
        for s in wanted:
            ev = [t for t in loaded_traces if t.shared_tokens == s and t.split == "eval"]
            cal = [t for t in loaded_traces if t.shared_tokens == s and t.split == "calibration"]
            if not ev:
                raise BenchError(f"{traces_path} has no trajectories with shared_tokens {s} (has {lengths})")
            if len(ev) < num_trajectories:
                raise BenchError(f"{traces_path} has {len(ev)} trajectories at shared_tokens {s}, "
                                 f"{num_trajectories} asked")
            if needs_calib and not cal:
                raise BenchError(f"{traces_path} has no calibration trajectories for {', '.join(needs_calib)}")
            groups[s] = (ev[:num_trajectories], cal)
    else:
        if texts is None:
            from .traces import mmlu_texts

            texts = mmlu_texts()
        for s in dict.fromkeys(int(x) for x in shared_tokens):
            trs = build_traces(backend.tokenizer, num_trajectories, s, output_tokens, seed, accumulated,
                               context_tokens, calib_trajectories, texts=texts)
            groups[s] = ([t for t in trs if t.split == "eval"], [t for t in trs if t.split == "calibration"])
    all_traces = [t for ev, cal in groups.values() for t in ev + cal]
    check_fits(all_traces, max_pos, vocab)

    out_dir.mkdir(parents=True, exist_ok=True)
    save_traces(all_traces, out_dir / "traces.jsonl")
    traces_sha = hashlib.sha256((out_dir / "traces.jsonl").read_bytes()).hexdigest()
    from ..runner import _git_revision, _versions

    config = {
        "command": "serve-sweep", "methods": names, "qps": qps_list, "qps_unit": QPS_UNIT,
        "shared_tokens": list(groups), "accumulated": accumulated,
        "context_tokens": sorted({t.context_tokens for t in all_traces}),
        "output_tokens": sorted({t.output_tokens for t in all_traces}),
        "num_trajectories": num_trajectories,
        "calibration_trajectories": {s: [t.id for t in cal] for s, (_, cal) in groups.items()},
        "burstiness": burstiness, "seed": seed, "traces_path": traces_path, "traces_sha256": traces_sha,
        "model": model_name if model_name is not None else getattr(backend, "model_name", None),
        "model_source": model_source, "dtype": dtype, "device": str(backend.describe().get("device")),
        "backend": backend.name, "method_args": method_args or {},
        "ignore_eos": ignore_eos, "warmup": warmup, "server": SERVER_MODEL,
        "agents": [a.name for a in all_traces[0].agents], "topology": f"chain of {N_AGENTS} agents",
        "versions": _versions(), "git_revision": _git_revision(), "hardware": _hardware(config_device(backend)),
    }
    cfg_path = out_dir / "config.json"
    service_path = out_dir / "service.jsonl"
    measured_before: dict = {}
    if cfg_path.exists():
        try:
            old = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            raise BenchError(f"{cfg_path} is not valid JSON; use another --output-path") from None
        diff = [k for k in MEASURE_KEYS if old.get(k) != config.get(k)]
        if diff and diff[0] == "traces_sha256":
            raise BenchError(f"{out_dir} holds a sweep measured on other traces (shared lengths, trajectories, "
                             "output tokens or seed differ); use another --output-path")
        if diff:
            raise BenchError(f"{out_dir} holds a sweep measured with a different {diff[0]} "
                             f"({old.get(diff[0])!r} vs {config.get(diff[0])!r}); use another --output-path")
        measured_before = _read_service(service_path)
        config["method_configs"] = {k: v for k, v in (old.get("method_configs") or {}).items()}
    elif service_path.exists():
        service_path.unlink()
    # keep only complete measurements; rewrite the file without torn or partial groups
    measured_before = {k: v for k, v in measured_before.items()
                       if len(v) >= num_trajectories and all(len(tr) == N_AGENTS for tr in v)}
    _write_jsonl(service_path, [{"method": m, "shared_tokens": s, **r.to_dict()}
                                for (m, s), v in measured_before.items() for tr in v for r in tr])
    config["backend_config"] = backend.describe()
    write_json(cfg_path, config)

    measured: dict[tuple[str, int], list[list[ServiceRecord]]] = {}
    for s, (ev, cal) in groups.items():
        for name in names:
            ids = [t.id for t in ev]
            prev = measured_before.get((name, s))
            if prev is not None and [tr[0].trajectory for tr in prev][:len(ids)] == ids:
                measured[(name, s)] = prev[:len(ids)]
                say(f"{name} @ {s} shared tokens: reusing saved measurements")
                continue
            say(f"{name} @ {s} shared tokens: preparing (calibration/warm-up on {len(cal)} held-out trajectories)")
            m = backend.prepare(name, cal, method_args)
            config.setdefault("method_configs", {})[name] = m.config() if hasattr(m, "config") else {}
            service = []
            for i, tr in enumerate(ev):
                service.append(backend.measure(tr, m))
                say(f"{name} @ {s}: trajectory {i + 1}/{len(ev)} measured "
                    f"({sum(r.service_s for r in service[-1]):.2f} s service)")
            del m
            _append_service(service_path, name, s, service)
            measured[(name, s)] = service
    config["backend_config"] = backend.describe()
    write_json(cfg_path, config)
    return finish(out_dir, config, measured, qps_list, burstiness, seed, plots, console if show_table else None)


def evaluate_service(output_path: str, qps: list[float], burstiness: float | None = None,
                     seed: int | None = None, plots: bool = True, console=None) -> dict:
    """Re-sweep the measurements saved in ``output_path`` (no model needed) at other QPS values."""
    out_dir = Path(output_path)
    cfg_path = out_dir / "config.json"
    if not cfg_path.exists():
        raise BenchError(f"{out_dir} holds no serve-sweep (config.json missing)")
    config = json.loads(cfg_path.read_text(encoding="utf-8"))
    burstiness = config.get("burstiness", 1.0) if burstiness is None else burstiness
    seed = config.get("seed", 0) if seed is None else seed
    _, qps_list = validate(config["methods"], qps, [], 1, burstiness, 1, 0, True)
    measured = _read_service(out_dir / "service.jsonl")
    if not measured:
        raise BenchError(f"{out_dir}/service.jsonl holds no measurements")
    n = config.get("num_trajectories")
    measured = {k: v[:n] for k, v in measured.items()
                if k[0] in config["methods"] and k[1] in config["shared_tokens"]}
    config.update(qps=qps_list, burstiness=burstiness, seed=seed)
    write_json(cfg_path, config)
    return finish(out_dir, config, measured, qps_list, burstiness, seed, plots, console)
