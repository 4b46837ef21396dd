"""The ``run`` job: samples -> workflow -> records -> summary, resumable."""

from __future__ import annotations

import os
import platform
import random
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from .engine import Engine
from .errors import BenchError
from .methods import get_method
from .results.records import RunDir, write_json
from .results.summary import summarize
from .workflow import Workflow
from .workloads import get_workload


@dataclass
class RunOptions:
    method: str = "nonshared"
    workload: str = "mmlu"
    model: str | None = None
    limit: int | None = None
    output_path: str = "runs/latest"
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    subjects: list[str] | None = None
    data_path: str | None = None
    max_new_tokens: int | None = None
    final_max_new_tokens: int | None = None
    fidelity: bool = False
    calib_samples: int = 4
    topology: str = "chain"
    agents: int | None = None
    rounds: int = 1
    target_reuse: float | None = None
    method_args: dict = field(default_factory=dict)


def _versions() -> dict:
    out = {}
    for pkg in ("kvcmas-bench", "torch", "transformers", "datasets", "vllm"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def hardware(device: torch.device) -> dict:
    hw = {"platform": platform.platform(), "python": platform.python_version(),
          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(device)
        hw["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return hw


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


def validate(opts: RunOptions) -> None:
    if opts.target_reuse is not None and not 0.0 <= opts.target_reuse <= 1.0:
        raise BenchError(f"--target-reuse must lie in [0, 1], got {opts.target_reuse}")
    if opts.calib_samples < 1:
        raise BenchError(f"--calib-samples must be a positive integer, got {opts.calib_samples}")
    for k, v in opts.method_args.items():
        if v is None:
            continue
        if k in ("rank", "anchors") and v < 1:
            raise BenchError(f"--{k} must be a positive integer, got {v}")
        if k == "anchor_dtype" and v not in ("bfloat16", "float32", "float16"):
            raise BenchError(f"--anchor-dtype must be bfloat16, float16 or float32, got {v!r}")
        if k in ("tau", "rho") and not 0.0 <= v <= 1.0:
            raise BenchError(f"--{k} must lie in [0, 1], got {v}")
    from .workflow import TOPOLOGIES

    if opts.topology not in TOPOLOGIES:
        raise BenchError(f"unknown --topology {opts.topology!r}; use one of {', '.join(TOPOLOGIES)}")
    if opts.agents is not None and opts.agents < 2:
        raise BenchError(f"--agents must be at least 2 (task agents + the final agent), got {opts.agents}")
    if opts.rounds < 1:
        raise BenchError(f"--rounds must be a positive integer, got {opts.rounds}")
    if opts.limit is not None and opts.limit < 1:
        raise BenchError(f"--limit must be a positive integer, got {opts.limit}")
    for flag, v in (("--max-new-tokens", opts.max_new_tokens), ("--final-max-new-tokens", opts.final_max_new_tokens)):
        if v is not None and v < 1:
            raise BenchError(f"{flag} must be a positive integer, got {v}")


def run(opts: RunOptions, progress=None) -> dict:
    """Run (or resume) one benchmark and return its summary."""
    from .modeling import load_model, resolve_device, resolve_dtype

    validate(opts)
    workload = get_workload(opts.workload, data_path=opts.data_path, subjects=opts.subjects)
    method_args = dict(opts.method_args)
    method = get_method(opts.method, **_method_kwargs(opts.method, method_args, workload))
    device = resolve_device(opts.device)
    resolve_dtype(opts.dtype)
    all_samples = workload.load()
    samples = select_samples(all_samples, opts.limit, opts.seed)
    if not samples:
        raise BenchError("no samples selected (check --subjects / --data-path)")
    from . import vlm

    visual = vlm.is_visual(workload)
    lm = (vlm.load_vlm if visual else load_model)(opts.model, opts.dtype, str(device))
    engine = Engine(lm.model, lm.tokenizer)

    def make_flow(m, fidelity=False):
        kw = dict(fidelity=fidelity, topology=opts.topology, agents=opts.agents, rounds=opts.rounds)
        if visual:
            return vlm.VLMWorkflow(engine, m, workload, opts.max_new_tokens, opts.final_max_new_tokens,
                                   processor=lm.processor, **kw)
        return Workflow(engine, m, workload, opts.max_new_tokens, opts.final_max_new_tokens, **kw)

    flow = make_flow(method, opts.fidelity)
    calib: list = []
    if method.needs_calibration or opts.target_reuse is not None:
        calib = calibration_samples(all_samples, {s.id for s in samples}, opts.calib_samples, opts.seed)
        if not calib:
            raise BenchError("no calibration samples left outside the evaluated ones; lower --limit")
    if method.needs_calibration:
        from .calibration import collect

        obs = collect(make_flow, calib, with_reference=method.calibration_reference)
        method.calibrate(obs, engine.n_layers)
    chosen_tau = None
    if opts.target_reuse is not None:
        if not hasattr(method, "tau"):
            raise BenchError(f"--target-reuse applies to methods with a gate threshold, not {opts.method!r}")
        method, chosen_tau = auto_tau(method, make_flow, calib, opts.target_reuse)
        flow = make_flow(method, opts.fidelity)
    config = {
        "method": opts.method, "method_config": method.config(), "workload": opts.workload,
        "model": lm.name, "model_source": lm.source, "dtype": opts.dtype, "device": str(device),
        "seed": opts.seed, "limit": opts.limit, "subjects": opts.subjects, "data_path": opts.data_path,
        "max_new_tokens": flow.max_new, "final_max_new_tokens": flow.final_max_new,
        "fidelity": opts.fidelity, "topology": opts.topology, "n_agents": flow.n_agents, "rounds": opts.rounds, "calibration_samples": [s.id for s in calib],
        "target_reuse": opts.target_reuse, "auto_tau": chosen_tau, "agents": [r.name for r, _ in flow.agents()],
        "prefix_caching": False, "decoding": "greedy", "engine": "in-process (one request at a time)",
        "versions": _versions(), "git_revision": _git_revision(), "hardware": hardware(device),
    }
    out = RunDir(opts.output_path, config)
    todo = [s for s in samples if s.id not in out.done_ids]
    if progress is not None:
        progress.start(total=len(samples), done=len(samples) - len(todo))
    for sample in todo:
        sample_rec, req_recs = run_one(flow, sample, engine, method)
        out.append(sample_rec, req_recs)
        if progress is not None:
            progress.advance(sample_rec)
    wanted = {s.id for s in samples}
    summary = summarize([s for s in out.samples if s["sample_id"] in wanted],
                        [r for r in out.requests if r["sample_id"] in wanted],
                        {"method": opts.method, "workload": opts.workload, "model": lm.name,
                         "device": str(device)})
    write_json(out.summary_path, summary)
    return summary


def tau_for_reuse(entropies: list[tuple[float, int]], target: float) -> float:
    """Smallest tau whose accepted gate decisions cover ``target`` of the gated tokens."""
    if not entropies:
        raise BenchError("--target-reuse: calibration produced no gate decisions (too few samples?)")
    total = sum(n for _, n in entropies)
    acc = 0
    tau = -1.0
    for h, n in sorted(entropies):
        if acc / total >= target:
            break
        acc += n
        tau = h
    return tau


def auto_tau(method, flow_factory, calib: list, target: float):
    """Run calibration samples with the gate closed (dense everywhere, pools filling as in a real
    run), record every gate's entropy, and return a fresh method whose tau reaches ``target``."""
    cfg = {k: v for k, v in method.config().items() if k != "name"}
    probe = type(method)(**{**cfg, "tau": -1.0})
    flow = flow_factory(probe)
    for s in calib:
        flow.run_sample(s)
    tau = tau_for_reuse(probe.entropies, target)
    return type(method)(**{**cfg, "tau": tau}), tau


def _method_kwargs(name: str, args: dict, workload) -> dict:
    """Workload defaults (e.g. tau) for the methods that take them, then user overrides."""
    from .methods import METHODS
    from dataclasses import fields

    if name not in METHODS:
        return args
    known = {f.name for f in fields(METHODS[name])}
    kw = {}
    if "tau" in known:
        kw["tau"] = workload.default_tau
    for k, v in args.items():
        if v is None:
            continue
        if k not in known:
            raise BenchError(f"--{k.replace('_', '-')} does not apply to method {name!r}")
        kw[k] = v
    return kw


def run_one(flow: Workflow, sample, engine: Engine, method) -> tuple[dict, list[dict]]:
    """Run one sample through the workflow; return its sample record and request records."""
    sr = flow.run_sample(sample)
    pred, correct = flow.workload.score(sample, sr.final_text)
    reqs = []
    for i, step in enumerate(sr.steps):
        r = step.result
        state = method.state_bytes()
        kv_state = r.kv_bytes + getattr(r, "shared_store_bytes", 0) + state
        rec = {
            "sample_id": sample.id, "step": i, "agent": step.role.name, "ttft_s": r.ttft_s,
            "e2e_s": r.e2e_s, "prompt_tokens": r.prompt_tokens, "output_tokens": len(r.output_ids),
            "prefilled_tokens": r.prefilled_tokens, "reused_tokens": r.reused_tokens,
            "eligible_tokens": r.eligible_tokens, "reference_tokens": r.reference_tokens,
            "recomputed_token_layers": r.recomputed_token_layers, "layers": engine.n_layers,
            "kv_bytes": r.kv_bytes, "method_state_bytes": state, "kv_state_bytes": kv_state,
            "peak_rss_bytes": r.peak_rss_bytes,
            "peak_mem_bytes": r.device_peak_bytes if r.device_peak_bytes is not None else r.peak_rss_bytes,
            "segments": [{k: v for k, v in s.items() if k != "kv_rel_error_per_layer"} for s in r.segments],
            "output": step.text,
        }
        if r.fidelity is not None:
            errs = [s["kv_rel_error"] for s in r.segments if "kv_rel_error" in s and s.get("source_agent")]
            rec.update({"top1_agree": r.fidelity["top1_agree"], "first_token_kl": r.fidelity["first_token_kl"],
                        "kv_rel_error": (sum(errs) / len(errs)) if errs else None,
                        "kv_rel_error_per_layer": [s.get("kv_rel_error_per_layer") for s in r.segments
                                                   if "kv_rel_error_per_layer" in s]})
        reqs.append(rec)
    sample_rec = {
        "sample_id": sample.id, "gold": sample.gold, "prediction": pred, "correct": bool(correct),
        "latency_s": sum(s.result.e2e_s for s in sr.steps),
        "ttft_s": sum(s.result.ttft_s for s in sr.steps) / len(sr.steps),
        "final_output": sr.final_text, "meta": sample.meta,
    }
    if getattr(sr, "visual", None):
        sample_rec["visual"] = sr.visual  # kind, visual tokens, vision-encoder seconds (once per sample)
    return sample_rec, reqs
