"""The experiments behind the paper's claims, at three scales, each one existing command.

An :class:`Experiment` is one ``kvcmas-bench`` command line (suite, ablate, analyze, serve-sweep)
that writes one subdirectory of the reproduce directory; ``reproduce`` runs it as a child process
(so a crash, an out-of-memory kill or a ``kill -9`` ends that experiment only and its own resume
picks it up) and never re-implements what it measures. The scales:

- ``smoke``: every experiment at the smallest size that still exercises it, on the default model and
  a 2-core CPU (short token budgets, a few samples, 1K-2K shared tokens); verdicts are mostly
  inconclusive there: the point is that every claim's pipeline runs end to end.
- ``small``: sizes at which the statistics can separate methods on one GPU (hundreds of samples,
  three seeds, 8K shared tokens).
- ``paper``: the paper's settings (Appendix B: full test splits, three runs, 2K-32K shared tokens,
  QPS up to 8). Run it with the paper's model (``--model meta-llama/Llama-3.1-8B-Instruct``).

The VLM workloads (MathVista, Video-MME) need a vision-language model and their data; their
experiments are listed with that reason and skipped unless ``--vlm-model`` names one.

:func:`estimate_cost` sizes each experiment (requests, prefilled and generated tokens, disk) and
turns tokens into seconds with a per-token cost measured on this device
(:func:`measure_token_cost`) or, when the model cannot be loaded here (a dry run of the paper's
8B model on a laptop), a nominal one derived from the parameter count (stated as assumed).
"""

from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import dataclass, field

SCALES = ("smoke", "small", "paper")
TEXT_WORKLOADS = ("mmlu", "gsm8k", "humaneval")
VLM_WORKLOADS = ("mathvista", "videomme")
#: mean prompt tokens of one agent request per workload (SmolLM2 tokenizer, from the CI baseline
#: and a 20-sample run; the estimate's only workload constant)
PROMPT_TOKENS = {"mmlu": 245, "gsm8k": 320, "humaneval": 420, "mathvista": 900, "videomme": 2200}
AGENTS = 4
#: samples in flight of the accuracy suites on ``--engine vllm``, per scale
CONCURRENCY = {"smoke": 4, "small": 16, "paper": 32}
#: Table 1's methods the vLLM engine cannot run (they enter layers with the source's hidden states)
NOT_ON_VLLM = ("droidspeak", "relaycaching")
#: bytes written per agent request record (requests.jsonl, with segment records), for the disk estimate
RECORD_BYTES = 3000


@dataclass
class Experiment:
    """One command of the plan: ``argv`` after ``kvcmas-bench`` (without ``-o`` and the model
    flags, which :func:`command` adds), the reader of its results and its size."""

    name: str
    reader: str
    argv: list[str]
    what: str
    #: why it cannot run here (it is listed, skipped, and its claims are "not comparable")
    skip: str | None = None
    #: the experiment whose claims its facts belong to (None: its own; a part of one run apart)
    facts_as: str | None = None
    requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    @property
    def disk_bytes(self) -> int:
        return self.requests * RECORD_BYTES


@dataclass(frozen=True)
class Sizes:
    limit: int | None
    seeds_limit: int | None
    #: samples per point of the agents / rounds scaling (their requests grow with N and R)
    scaling_limit: int | None
    warmup: int
    calib: int
    new_tokens: int | None
    repeats: int
    ablate_limit: int
    rank_limit: int
    chain_limit: int | None
    workloads: tuple[str, ...]
    shared: tuple[int, ...]
    memory_shared: tuple[int, ...]
    generated: tuple[int, ...]
    qps: tuple[float, ...]
    trajectories: int
    output_tokens: int
    agents: tuple[int, ...]
    rounds: tuple[int, ...]
    scaling_methods: tuple[str, ...]
    ranks: tuple[int, ...]
    anchors: tuple[int, ...]


ALL_SHARING = ("cacheblend", "droidspeak", "relaycaching", "graphflow", "kvcomm")
SIZES = {
    "smoke": Sizes(
        limit=3,
        warmup=2,
        calib=2,
        new_tokens=8,
        repeats=3,
        seeds_limit=2,
        scaling_limit=1,
        ablate_limit=2,
        rank_limit=2,
        chain_limit=3,
        workloads=("mmlu",),
        shared=(1024,),
        memory_shared=(2048,),
        generated=(192,),
        qps=(0, 8),
        trajectories=3,
        output_tokens=8,
        agents=(2, 4),
        rounds=(1, 2),
        scaling_methods=("kvcmas", "cacheblend"),
        ranks=(16, 32, 64),
        anchors=(5, 10, 20),
    ),
    "small": Sizes(
        limit=200,
        seeds_limit=200,
        scaling_limit=100,
        warmup=20,
        calib=4,
        new_tokens=None,
        repeats=3,
        ablate_limit=100,
        rank_limit=16,
        chain_limit=200,
        workloads=TEXT_WORKLOADS,
        shared=(2048, 8192),
        memory_shared=(2048, 8192),
        generated=(1536,),
        qps=(0, 1, 2, 4, 8),
        trajectories=16,
        output_tokens=128,
        agents=(2, 4, 8),
        rounds=(2, 4, 8),
        scaling_methods=("kvcmas", *ALL_SHARING),
        ranks=(16, 32, 64),
        anchors=(1, 2, 5, 10, 20),
    ),
    "paper": Sizes(
        limit=None,
        seeds_limit=None,
        scaling_limit=1000,
        warmup=50,
        calib=4,
        new_tokens=None,
        repeats=3,
        ablate_limit=1000,
        rank_limit=64,
        chain_limit=None,
        workloads=TEXT_WORKLOADS,
        shared=(2048, 8192, 32768),
        memory_shared=(2048, 8192, 32768),
        generated=(384, 1536, 6144),
        qps=(0, 1, 2, 4, 8),
        trajectories=32,
        output_tokens=128,
        agents=(2, 4, 8),
        rounds=(2, 4, 8),
        scaling_methods=("kvcmas", *ALL_SHARING),
        ranks=(16, 32, 64, 128),
        anchors=(1, 2, 5, 10, 20),
    ),
}
#: samples per workload of the full test splits (for the paper scale's estimate)
FULL_SPLIT = {"mmlu": 14042, "gsm8k": 1319, "humaneval": 164, "mathvista": 1000, "videomme": 2700}
METHODS_ALL = 10


def _csv(xs) -> str:
    return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs)


def _budget(z: Sizes) -> list[str]:
    return ["--max-new-tokens", str(z.new_tokens), "--final-max-new-tokens", str(z.new_tokens)] if z.new_tokens else []


def _eval_flags(z: Sizes, limit: int | None) -> list[str]:
    lim = ["--limit", str(limit)] if limit else []
    return [*lim, "--warmup", str(z.warmup), "--calib-samples", str(z.calib), *_budget(z)]


def _n(z: Sizes, workload: str, limit: int | None) -> int:
    return min(limit, FULL_SPLIT[workload]) if limit else FULL_SPLIT[workload]


# fmt: off
def _runs_cost(e: Experiment, z: Sizes, workloads, limit, methods: int, calibrating: int = 0, agents=AGENTS,
               rounds=1, repeats=1, fidelity=False) -> None:
    """Add the requests of ``methods`` runs per workload: measured and warm-up samples for every
    method, calibration samples for the ``calibrating`` ones (GraphFlow, DroidSpeak, RelayCaching)."""
    new = z.new_tokens or 128
    for w in workloads:
        samples = ((_n(z, w, limit) + z.warmup) * methods + z.calib * calibrating) * repeats
        reqs = samples * agents * rounds
        e.requests += reqs
        e.prefill_tokens += reqs * PROMPT_TOKENS[w] * (2 if fidelity else 1)
        e.decode_tokens += reqs * new


def _sweep_cost(e: Experiment, z: Sizes, shared, methods: int, qps_points: int, engine: str, traj=None,
                out_tok=None) -> None:
    traj = (traj or z.trajectories) + 2  # and the held-out calibration trajectories
    served = traj * AGENTS * methods * len(shared)
    factor = qps_points if engine == "vllm" else 1  # the in-process engine measures each request once
    e.requests += served * factor
    e.prefill_tokens += sum((s + 200) * traj * AGENTS * methods for s in shared) * factor
    e.decode_tokens += served * factor * (out_tok or z.output_tokens)


def plan(scale: str, engine: str = "in-process", vlm_model: str | None = None) -> list[Experiment]:
    """Every experiment of ``scale`` (unrun; see :func:`command` for its full command line)."""
    z = SIZES[scale]
    out: list[Experiment] = []

    def add(name: str, reader: str, argv: list[str], what: str) -> Experiment:
        out.append(Experiment(name, reader, argv, what))
        return out[-1]

    _accuracy_experiments(add, z, scale, engine)
    _serving_experiments(add, z, scale, engine)
    for name, argv, what, wl in (
        ("chain-vlm", ["analyze", "chain", "--workloads", "videomme", *_eval_flags(z, z.chain_limit)],
         "chained vs non-chained KVCMAS on Video-MME (Table 8)", "the Video-MME videos"),
        ("coverage", ["analyze", "coverage", "--workload", "mathvista", "--limit", str(min(z.rank_limit * 4, 64)),
                      "--rho", "0.8"], "reconstruction coverage of selective recomputation on a VLM workload "
         "(Table 2)", "the MathVista data"),
    ):
        e = add(name, "runs" if name == "chain-vlm" else "coverage", argv, what)
        if name == "chain-vlm":
            _runs_cost(e, z, ("videomme",), z.chain_limit, 2, fidelity=True)
        else:
            _runs_cost(e, z, ("mathvista",), min(z.rank_limit * 4, 64), 1)
        if vlm_model is None:
            e.skip = f"needs a vision-language model (give --vlm-model) and {wl}"
        else:
            e.argv += ["--model", vlm_model]
    return out


def _accuracy_experiments(add, z: Sizes, scale: str, engine: str = "in-process") -> None:
    """Table 1, the seeds, the chain and rank analyses and the four ablations (text workloads).

    ``engine`` "vllm": Table 1 and the seeds run on the vLLM deployment, :data:`CONCURRENCY` samples
    in flight (Table 1's methods that vLLM cannot run, in-process beside them: their own suite with
    its own NonShared); the analyses and ablations record fidelity, which only the in-process
    engine measures, so they stay there."""
    wl = _csv(z.workloads)
    reps = "3" if scale == "paper" else "1"
    served = ["--engine", "vllm", "--max-concurrency", str(CONCURRENCY[scale])] if engine == "vllm" else []
    e = add("table1", "runs", ["suite", "--methods", "all", "--workloads", wl, *_eval_flags(z, z.limit),
                               "--repeats", reps, *served],
            "Table 1: every method (accuracy, latency, TTFT, peak memory)")
    _runs_cost(e, z, z.workloads, z.limit, METHODS_ALL, 3, repeats=int(reps))
    if served:
        e.what += " on vLLM, the methods it runs"
        e = add("table1-in-process", "runs", ["suite", "--methods", _csv(NOT_ON_VLLM), "--workloads", wl,
                                              *_eval_flags(z, z.limit), "--repeats", reps],
                "Table 1: the methods vLLM cannot run (they need the source's hidden states), in-process")
        e.facts_as = "table1"
        _runs_cost(e, z, z.workloads, z.limit, len(NOT_ON_VLLM) + 1, 3, repeats=int(reps))
    e = add("seeds", "runs", ["suite", "--methods", "kvcmas", "--workloads", wl, *_eval_flags(z, z.seeds_limit),
                              "--repeats", str(z.repeats), "--no-plots", *served],
            "accuracy of KVCMAS over three seeds (Table 5)")
    _runs_cost(e, z, z.workloads, z.seeds_limit, 2, repeats=z.repeats)
    e = add("chain", "runs", ["analyze", "chain", "--workloads", "mmlu", *_eval_flags(z, z.chain_limit)],
            "chained vs non-chained KVCMAS on the same samples (Table 8, Figure 3)")
    _runs_cost(e, z, ("mmlu",), z.chain_limit, 2, fidelity=True)
    e = add("rank", "rank", ["analyze", "rank", "--workloads", wl, "--limit", str(z.rank_limit), *_budget(z)],
            "effective rank of caches and deltas (Figures 2 and 7)")
    _runs_cost(e, z, z.workloads, z.rank_limit, 1)
    for kind, values, what in (
        ("rank", z.ranks, "rank ablation r_C = r_D (Figure 13)"),
        ("anchors", z.anchors, "anchor pool size V (Table 13)"),
    ):
        e = add(f"ablate-{kind}", "runs", ["ablate", kind, "--values", _csv(values), "--workloads", "mmlu",
                                           *_eval_flags(z, z.ablate_limit)], what)
        _runs_cost(e, z, ("mmlu",), z.ablate_limit, len(values) + 1, fidelity=True)
    for kind, values, what in (
        ("agents", z.agents, "number of agents N (Table 14)"),
        ("rounds", z.rounds, "number of rounds R (Table 15)"),
    ):
        e = add(f"ablate-{kind}", "runs", ["ablate", kind, "--values", _csv(values), "--methods",
                                           _csv(z.scaling_methods), "--workloads", "mmlu",
                                           *_eval_flags(z, z.scaling_limit)], what)
        for v in values:
            _runs_cost(e, z, ("mmlu",), z.scaling_limit, len(z.scaling_methods) + 1, fidelity=True,
                       agents=v if kind == "agents" else AGENTS, rounds=v if kind == "rounds" else 1)


def _serving_experiments(add, z: Sizes, scale: str, engine: str) -> None:
    """The serve-sweeps: TTFT under load at matched rho, anchor memory, accumulated contexts."""
    sweep = ["serve-sweep", "--num-trajectories", str(z.trajectories), "--output-tokens", str(z.output_tokens)]
    engine_flags = ["--engine", engine] if engine != "in-process" else []
    e = add("load", "sweep", [*sweep, *engine_flags, "--methods", "nonshared,graphflow,kvcmas,kvcmas-nonchained",
                              "--shared-tokens", _csv(z.shared), "--qps", _csv(z.qps), "--matched-rho", "paper-0.8"],
            "TTFT vs QPS at matched rho 0.8 (Figures 5, 6, 8)")
    _sweep_cost(e, z, z.shared, 4, len(z.qps), engine)
    # single stream: fewer trajectories and output tokens measure the same anchor bytes
    mem_traj = max(2, z.trajectories // 2)
    mem = ["serve-sweep", "--num-trajectories", str(mem_traj), "--output-tokens", "4", *engine_flags,
           "--methods", "kvcomm,kvcmas", "--qps", "0"]
    e = add("memory", "sweep", [*mem, "--shared-tokens", _csv(z.memory_shared)],
            "single-stream anchor memory, KVComm vs KVCMAS (Table 11)")
    _sweep_cost(e, z, z.memory_shared, 2, 1, engine, mem_traj, 4)
    v20 = max(z.shared) if scale == "smoke" else max(z.memory_shared)
    e = add("memory-v20", "sweep", [*mem, "--shared-tokens", str(v20), "--anchors", "20"],
            "anchor memory at matched V = 20 (Appendix C.3)")
    _sweep_cost(e, z, (v20,), 2, 1, engine, mem_traj, 4)
    # each agent generates a third of the accumulated length over a 2048-token fixed context
    gen_traj = mem_traj if scale == "smoke" else z.trajectories
    e = add("generated", "sweep", ["serve-sweep", "--num-trajectories", str(gen_traj), *engine_flags, "--methods",
                                   "nonshared,kvcmas", "--accumulated", "--shared-tokens", _csv(z.generated),
                                   "--qps", _csv(z.qps), "--matched-rho", "paper-0.8"],
            "TTFT with shared context generated by the agents (Appendix B.6)")
    for s in z.generated:
        _sweep_cost(e, z, (2048 + s,), 2, len(z.qps), engine, gen_traj, s // 3)
# fmt: on


def command(e: Experiment, out_dir: str, model: str | None, device: str, dtype: str, seed: int) -> list[str]:
    """The experiment's whole ``kvcmas-bench`` argument list."""
    flags = ["-o", out_dir, "--device", device, "--dtype", dtype, "--seed", str(seed)]
    if model and "--model" not in e.argv:
        flags += ["--model", model]
    return [*e.argv, *flags]


@dataclass
class TokenCost:
    """Seconds per prefilled and per generated token, and how they were obtained."""

    prefill_s: float
    decode_s: float
    basis: str
    notes: list[str] = field(default_factory=list)

    def seconds(self, e: Experiment) -> float:
        return e.prefill_tokens * self.prefill_s + e.decode_tokens * self.decode_s


def params_from_name(model: str | None) -> float | None:
    """``meta-llama/Llama-3.1-8B-Instruct`` -> 8e9 (the size in the name), None if it has none."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([BM])\b", model or "", re.IGNORECASE)
    if not m:
        return None
    return float(m.group(1)) * (1e9 if m.group(2).upper() == "B" else 1e6)


#: an A100 80GB's bf16 dense peak and memory bandwidth, used only when the device is not here
NOMINAL_GPU = {"flops": 312e12, "mfu": 0.4, "bandwidth": 2.0e12, "name": "A100 80GB (bf16, 40% of peak FLOP/s)"}


def nominal_cost(params: float, dtype_bytes: int = 2) -> TokenCost:
    """Prefill at 2 * params FLOPs per token and 40% of an A100's peak; decode bound by reading the
    weights once per token (batch 1)."""
    g = NOMINAL_GPU
    return TokenCost(
        2 * params / (g["flops"] * g["mfu"]),
        params * dtype_bytes / g["bandwidth"],
        f"assumed, not measured: {params / 1e9:.1f}B parameters on an {g['name']}",
        ["attention's quadratic cost at long contexts is not modelled"],
    )


def measure_token_cost(model: str | None, device: str, dtype: str, prompt: int = 256, steps: int = 8) -> TokenCost:
    """Load the model on the device and time one ``prompt``-token prefill and ``steps`` decode steps
    (after one untimed warm-up pass), CUDA-synchronized."""
    import torch

    from ..modeling import load_model, resolve_device

    lm = load_model(model, dtype, device)
    dev = resolve_device(device)
    ids = torch.randint(10, 1000, (1, prompt), device=dev)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the deprecation notes of the plain forward calls below
    try:
        return _time_passes(lm, ids, dev, steps, prompt, dtype)
    finally:
        hf_logging.set_verbosity(verbosity)


def _time_passes(lm, ids, dev, steps: int, prompt: int, dtype: str) -> TokenCost:
    import torch

    def sync():
        if str(dev).startswith("cuda"):
            torch.cuda.synchronize()

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm.model(ids[:, :32])
        sync()
        t0 = time.perf_counter()
        out = lm.model(ids, use_cache=True)
        sync()
        t1 = time.perf_counter()
        past, tok = out.past_key_values, ids[:, -1:]
        for _ in range(steps):
            out = lm.model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
        sync()
        t2 = time.perf_counter()
    return TokenCost((t1 - t0) / prompt, (t2 - t1) / steps, f"measured on {dev} with {lm.name} ({dtype})")


def human_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def human_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1000:
            return f"{b:.0f} {unit}"
        b /= 1000
    return f"{b:.1f} TB"
