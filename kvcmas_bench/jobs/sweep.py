"""The ``serve-sweep`` job: serve controlled traces with every method on an engine, across QPS.

For every shared-context length the controlled traces (:mod:`~kvcmas_bench.serving.traces`) are
built once (or loaded), each method is prepared on the backend (calibration and warm-up on held-out
trajectories) and the engine serves the evaluated trajectories under the seeded arrivals of every
QPS value (:mod:`~kvcmas_bench.serving.arrivals`; the same pattern, scaled by 1/qps, for every
method), returning served timelines. QPS counts trajectory starts per second; agent ``j + 1``
arrives when agent ``j`` completes; QPS 0 is single stream. The in-process engine measures each
request once in isolation and replays the service times on a one-request-at-a-time FCFS server.

Matched reuse ratio (``matched_rho``, ``--matched-rho DELTA[,RECOMPUTE]`` or a paper preset): the
evaluated trajectories of every shared length get one schedule, drawn from the seed and the same
for every method (:func:`~kvcmas_bench.serving.traces.draw_schedule`), that makes ``1 - DELTA`` of
each family's reuse-eligible shared tokens dense and the rest reused by FullShared, GraphFlow,
KVComm and KVCMAS whatever their gates say; the selective-recomputation methods get ``rho =
RECOMPUTE`` instead. Without it nothing is scheduled and ``--rho`` reaches the recomputation methods
only, as before.

Output directory: ``config.json``, ``traces.jsonl`` (replayable), ``service.jsonl`` (one isolated
measurement a line, replaying engines), ``served.jsonl`` (engines that serve live, ``--engine vllm``:
every QPS point's served requests, appended as the point completes), ``requests.jsonl`` (one served request per
method/shared/qps a line, with its timeline), ``summary.json`` (one row per method/shared/qps) and
the TTFT plots. Measuring resumes: (method, shared length) pairs already in ``service.jsonl`` are not
measured again when the measurement settings match, and on live engines the (method, shared length,
QPS) points already in ``served.jsonl`` are not served again (a point is served whole: its requests
were measured under that point's load); :func:`evaluate_service` re-sweeps saved measurements
without a model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from ..console import print_sweep_table
from ..errors import BenchError
from ..methods import MethodSpec, expand_methods, resolve_methods
from ..results.outdir import atomic_write, lock_output_dir
from ..results.provenance import provenance
from ..results.records import read_jsonl_objects, write_json
from ..results.request import RequestRecord
from ..serving.arrivals import arrival_times, check_rate
from ..serving.engines import (
    ENGINE_LIMITS,
    EngineLost,
    ServeResult,
    ServingEngine,
    check_engine,
    get_engine,
    replay_all,
)
from ..serving.metrics import DEFINITIONS, QPS_UNIT, capacity, sweep_rows
from ..serving.traces import (
    DEFAULT_ACCUMULATED_CONTEXT,
    N_AGENTS,
    Trace,
    apply_schedule,
    build_traces,
    dense_transitions,
    dump_traces,
    load_traces,
    scheduled_rho,
)
from ..settings import MethodSettings, ModelSettings, cli, comma_floats, comma_ints, comma_list, parse_pairs

if TYPE_CHECKING:
    from rich.console import Console

    from ..modeling import LoadedModel

# settings that change measured service times: a resumed output directory must match them
MEASURE_KEYS = (
    "model",
    "dtype",
    "device",
    "engine",
    "method_args",
    "matched_rho",
    "traces_sha256",
    "ignore_eos",
    "warmup",
)
#: the workload whose questions form the shared context; its per-workload knob defaults (tau) apply
TEXT_WORKLOAD = "mmlu"

Measured = dict[tuple[str, int], list[list[RequestRecord]]]
#: served QPS points saved by a live engine: (method, shared length, qps) -> its requests
Points = dict[tuple[str, int, float], list[RequestRecord]]
SERVED = "served.jsonl"

#: ``--matched-rho`` presets: the paper's serving pairs (Section 4.3, Appendix B.4): delta correction
#: at rho 0.8 against selective recomputation at 0.9, and 0.6 against 0.8
RHO_PRESETS = {"paper-0.8": (0.8, 0.9), "paper-0.6": (0.6, 0.8)}


@dataclass(frozen=True)
class MatchedRho:
    """A matched reuse ratio: ``delta`` for the scheduled methods (the share of eligible shared
    tokens they reuse), ``recompute`` for the selective-recomputation methods' ``rho`` knob."""

    delta: float
    recompute: float
    preset: str | None = None

    def config(self) -> dict:
        return {"delta": self.delta, "recompute": self.recompute}


def parse_matched_rho(value) -> MatchedRho | None:
    """``"0.8"`` (both 0.8), ``"0.8,0.9"`` (DELTA,RECOMPUTE), a preset name (:data:`RHO_PRESETS`),
    a ``(delta, recompute)`` pair or a :class:`MatchedRho`; None stays None."""
    if value is None or isinstance(value, MatchedRho):
        return value
    preset = None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in RHO_PRESETS:
            preset, parts = text, list(RHO_PRESETS[text])
        else:
            try:
                parts = [float(x) for x in text.split(",") if x.strip()]
            except ValueError:
                parts = []
            if not 1 <= len(parts) <= 2:
                raise BenchError(
                    f"--matched-rho takes DELTA[,RECOMPUTE] (numbers in [0, 1]) or one of "
                    f"{', '.join(RHO_PRESETS)}, got {value!r}"
                )
    else:
        parts = [float(x) for x in value]
    if len(parts) == 1:
        parts.append(parts[0])
    for x in parts:
        if not 0.0 <= x <= 1.0:
            raise BenchError(f"--matched-rho values must lie in [0, 1], got {x:g}")
    return MatchedRho(parts[0], parts[1], preset)


def rho_role(cls) -> str | None:
    """How a method meets a matched rho: "recompute" (its ``rho`` knob), "schedule" (it follows the
    segments' schedule: FullShared, GraphFlow, KVComm, KVCMAS) or None (NonShared: reuses nothing)."""
    from ..methods.base import Method

    if "rho" in cls.knobs():
        return "recompute"
    return None if cls.materialize is Method.materialize else "schedule"


def rho_target(config: dict, method: str) -> float | None:
    """The rho ``method`` was set to under the sweep's matched rho (None without one)."""
    from ..methods import method_class

    m = config.get("matched_rho")
    if not m:
        return None
    try:
        role = rho_role(method_class(method))
    except BenchError:  # a method no longer registered: its saved rows stay readable
        return None
    return {"recompute": m.get("recompute"), "schedule": m.get("delta")}.get(role)


def validate(
    methods: Sequence[str],
    qps: Sequence[float],
    shared_tokens: Sequence[int],
    num_trajectories: int,
    burstiness: float,
    output_tokens: int,
    calib_trajectories: int,
    from_file: bool,
    warmup_trajectories: int = 0,
) -> tuple[list[str], list[float]]:
    """Check the sweep's options before anything loads; the method names and the sorted QPS values."""
    names = expand_methods(methods)
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
    if warmup_trajectories < 0:
        raise BenchError(f"--warmup-trajectories must be >= 0, got {warmup_trajectories}")
    return names, sorted({float(q) for q in qps})


def check_fits(
    traces: Sequence[Trace], max_positions: int | None, vocab: int | None, source: str | None = None
) -> None:
    """Every agent's prompt + output must fit the model context; every id the vocabulary (checked
    once the model is known, before any request runs). ``source``: the trace file the traces were
    read from, named with the trajectory and the field of an id past the vocabulary."""
    for tr in traces:
        need = tr.max_positions()
        if max_positions is not None and need > max_positions:
            what = (
                f"accumulated output of {tr.shared_tokens} tokens"
                if tr.accumulated
                else f"shared context of {tr.shared_tokens} tokens"
            )
            raise BenchError(
                f"{what} does not fit the model: the {len(tr.agents)} agents' prompts + "
                f"outputs reach {need} positions > max_position_embeddings {max_positions}; "
                "lower --shared-tokens or --output-tokens"
            )
        if vocab is not None:
            _check_vocab(tr, vocab, source)


def _check_vocab(tr: Trace, vocab: int, source: str | None) -> None:
    """Every token id of ``tr`` (context and PF segments) lies below the model's vocabulary size."""
    fields = [("context_ids", tr.context_ids)] + [
        (f"agents[{i}].segments[{j}].ids", s["ids"])
        for i, a in enumerate(tr.agents)
        for j, s in enumerate(a.segments)
        if s["kind"] == "PF"
    ]
    for where, ids in fields:
        if max(ids, default=0) < vocab:
            continue
        k = next(k for k, t in enumerate(ids) if t >= vocab)
        what = f"{source}: trajectory {json.dumps(tr.id)}: {where}[{k}]" if source else f"trace {tr.id}: {where}[{k}]"
        raise BenchError(
            f"{what} holds token id {ids[k]} >= vocabulary size {vocab} of the model (built with another tokenizer?)"
        )


def engine_methods(engine: str, asked: Sequence[str], names: list[str], backend=None) -> list[str]:
    """``--method all`` on an engine that cannot run every method: the ones it can (named ones are
    checked by :func:`~kvcmas_bench.serving.engines.check_engine` and refused)."""
    why_not = ENGINE_LIMITS.get(engine) or getattr(backend, "why_unsupported", None)
    if why_not is None or "all" not in [a.strip().lower() for a in asked]:
        return names
    from ..methods import method_class

    return [n for n in names if not why_not(method_class(n))]


@dataclass
class SweepSpec:
    """Validated inputs of one sweep: methods, QPS values and the traces to serve."""

    specs: dict[str, MethodSpec]
    qps: list[float]
    num_trajectories: int
    burstiness: float
    seed: int
    accumulated: bool
    traces_path: str | None
    groups: dict[int, tuple[list[Trace], list[Trace]]] = field(default_factory=dict)
    #: points a live engine served before this run (resumed from ``served.jsonl``)
    points: Points = field(default_factory=dict)

    @property
    def traces(self) -> list[Trace]:
        return [t for ev, cal in self.groups.values() for t in ev + cal]

    def schedules(self, n: int) -> dict[float, list[float] | None]:
        out = {}
        for q in self.qps:
            arr = arrival_times(n, q, self.burstiness, self.seed)
            out[q] = None if arr is None else list(arr)
        return out


def _groups_from_file(
    traces: list[Trace], path: str, shared_tokens: Sequence[int], n: int, accumulated: bool, needs_calib: list[str]
) -> dict[int, tuple[list[Trace], list[Trace]]]:
    kinds = {t.accumulated for t in traces}
    if kinds != {accumulated}:
        raise BenchError(
            f"{path} holds {'accumulated' if True in kinds else 'controlled'} traces "
            f"but accumulated={accumulated} was asked"
        )
    lengths = sorted({t.shared_tokens for t in traces})
    groups = {}
    for s in list(dict.fromkeys(int(x) for x in shared_tokens)) or lengths:
        ev = [t for t in traces if t.shared_tokens == s and t.split == "eval"]
        cal = [t for t in traces if t.shared_tokens == s and t.split in ("calibration", "warmup")]
        if not ev:
            raise BenchError(f"{path} has no trajectories with shared_tokens {s} (has {lengths})")
        if len(ev) < n:
            raise BenchError(f"{path} has {len(ev)} trajectories at shared_tokens {s}, {n} asked")
        if needs_calib and not any(t.split == "calibration" for t in cal):
            raise BenchError(f"{path} has no calibration trajectories for {', '.join(needs_calib)}")
        groups[s] = (ev[:n], cal)
    return groups


def _built_groups(
    tokenizer,
    shared_tokens: Sequence[int],
    n: int,
    output_tokens: int,
    seed: int,
    accumulated: bool,
    context_tokens: int,
    calib: int,
    texts,
    warmup: int = 0,
) -> dict:
    if texts is None:
        from ..serving.traces import mmlu_texts

        texts = mmlu_texts()
    groups = {}
    for s in dict.fromkeys(int(x) for x in shared_tokens):
        trs = build_traces(
            tokenizer,
            n,
            s,
            output_tokens,
            seed,
            accumulated,
            context_tokens,
            calib,
            texts=texts,
            warmup_trajectories=warmup,
        )
        groups[s] = ([t for t in trs if t.split == "eval"], [t for t in trs if t.split != "eval"])
    return groups


def sweep_config(
    sweep: SweepSpec,
    backend: ServingEngine,
    traces_text: str,
    method_args: dict,
    dtype: str,
    ignore_eos: bool,
    warmup: bool,
) -> dict:
    traces = sweep.traces
    device = str(backend.describe().get("device"))
    return {
        "command": "serve-sweep",
        "methods": list(sweep.specs),
        "qps": sweep.qps,
        "qps_unit": QPS_UNIT,
        "shared_tokens": list(sweep.groups),
        "accumulated": sweep.accumulated,
        "context_tokens": sorted({t.context_tokens for t in traces}),
        "output_tokens": sorted({t.output_tokens for t in traces}),
        "num_trajectories": sweep.num_trajectories,
        "calibration_trajectories": {
            s: [t.id for t in held if t.split == "calibration"] for s, (_, held) in sweep.groups.items()
        },
        "warmup_trajectories": {
            s: [t.id for t in held if t.split == "warmup"] for s, (_, held) in sweep.groups.items()
        },
        "burstiness": sweep.burstiness,
        "seed": sweep.seed,
        "traces_path": sweep.traces_path,
        "traces_sha256": hashlib.sha256(traces_text.encode("utf-8")).hexdigest(),
        "model": backend.model_name,
        "model_source": backend.model_source,
        "dtype": dtype,
        "device": device,
        "engine": backend.name,
        "method_args": method_args,
        "ignore_eos": ignore_eos,
        "warmup": warmup,
        "server": backend.server,
        "agents": [a.name for a in traces[0].agents],
        "topology": f"chain of {N_AGENTS} agents",
        **provenance(_torch_device(device)),
    }


def _torch_device(described: str) -> str:
    """The torch device an engine's described ``device`` names (an engine that reports something else,
    such as a server's own label, counts as the CPU)."""
    return described if described.startswith(("cpu", "cuda")) else "cpu"


def open_dir(out_dir: Path, config: dict, num_trajectories: int) -> Measured:
    """Check a resumed directory's measurement settings; return its complete saved measurements
    (and rewrite ``service.jsonl`` without torn or partial groups)."""
    cfg_path = out_dir / "config.json"
    service_path = out_dir / "service.jsonl"
    saved: Measured = {}
    if cfg_path.exists():
        old = _read_config(cfg_path)
        diff = [k for k in MEASURE_KEYS if old.get(k) != config.get(k)]
        if diff and diff[0] == "traces_sha256":
            raise BenchError(
                f"{out_dir} holds a sweep measured on other traces (shared lengths, trajectories, "
                "output tokens, seed or matched-rho schedule differ); use another --output-path"
            )
        if diff:
            raise BenchError(
                f"{out_dir} holds a sweep measured with a different {diff[0]} "
                f"({old.get(diff[0])!r} vs {config.get(diff[0])!r}); use another --output-path"
            )
        saved = _read_service(service_path)
        config["method_configs"] = dict(old.get("method_configs") or {})
        config["method_resolved"] = dict(old.get("method_resolved") or {})
    elif service_path.exists():
        service_path.unlink()
    saved = {k: v for k, v in saved.items() if len(v) >= num_trajectories and all(len(tr) == N_AGENTS for tr in v)}
    _write_jsonl(service_path, [r.to_dict() for v in saved.values() for tr in v for r in tr])
    return saved


@dataclass(kw_only=True)
class SweepOptions(ModelSettings, MethodSettings):
    """Every setting of one ``serve-sweep`` (the CLI builds one from its flags; :func:`run_sweep`
    runs it). The shared settings (model, device, dtype, seed, output path, method knobs):
    :class:`~kvcmas_bench.settings.ModelSettings` and :class:`~kvcmas_bench.settings.MethodSettings`;
    the seed also draws the arrival pattern and the rho schedule."""

    #: method names or ``["all"]`` (on an engine that cannot run every method: the ones it can)
    methods: list[str] = cli(parse=comma_list, factory=lambda: ["all"])
    #: trajectory arrival rates in trajectory starts per second; 0 = single stream
    qps: list[float] = cli(parse=comma_floats, factory=lambda: [0.0, 1.0, 2.0, 4.0, 8.0])
    #: non-generated shared context lengths (accumulated: output lengths; traces_path: those kept, [] = all)
    shared_tokens: list[int] = cli(parse=comma_ints, factory=lambda: [2048])
    #: evaluated trajectories per shared length
    num_trajectories: int = 4
    output_path: str = "runs/serve-sweep"
    #: also a loaded model (for an ``engine`` given as a name only)
    model: str | LoadedModel | None = None
    #: gamma shape of the inter-arrival gaps (1 = Poisson), as ``vllm bench serve``
    burstiness: float = 1.0
    #: tokens each agent generates
    output_tokens: int = 128
    #: shared context accumulated from agent outputs over ``context_tokens``, ``// 3`` per agent (paper B.6)
    accumulated: bool = False
    #: replay a saved ``traces.jsonl`` exactly instead of building traces
    traces_path: str | None = cli(None, source="traces")
    #: context tokens of accumulated traces
    context_tokens: int = DEFAULT_ACCUMULATED_CONTEXT
    #: held-out trajectories per shared length for calibration / pool warm-up
    calib_trajectories: int = 2
    #: more held-out trajectories served before measurement (pools in steady state; excluded from statistics)
    warmup_trajectories: int = 0
    #: matched reuse ratio ("DELTA[,RECOMPUTE]", a preset, a pair, a MatchedRho); sets rho, so method_args must not
    matched_rho: str | Sequence[float] | MatchedRho | None = None
    #: a registered engine name (``kvcmas-bench engines``), started with the settings here, or a ServingEngine instance
    engine: str | ServingEngine = "in-process"
    #: engine-specific options (``--engine-arg KEY=VALUE``: vLLM block size, KV cache size ...), checked early
    engine_options: dict = cli(source="engine_arg", parse=parse_pairs, factory=dict)
    #: generate exactly ``output_tokens`` per agent, EOS ignored (a started engine's setting)
    ignore_eos: bool = True
    #: warm each method up on the held-out trajectories before measuring (a started engine's setting)
    warmup: bool = True
    #: draw the TTFT-vs-QPS plots (PNG and SVG)
    plots: bool = True
    #: print the summary table
    show_table: bool = True
    #: the question texts the shared contexts are built from (None: MMLU's)
    texts: Sequence[str] | None = None


@dataclass
class SweepPlan:
    """What :func:`resolve` checked and decided before any model loads or anything is written."""

    engine_name: str
    specs: dict[str, MethodSpec]
    qps: list[float]
    matched: MatchedRho | None
    #: the methods that calibrate
    needs_calib: list[str]
    #: the traces of ``traces_path`` (None: traces are built)
    loaded: list[Trace] | None


def run_sweep(
    opts: SweepOptions, progress: Callable[[str], None] | None = None, console: Console | None = None
) -> dict:
    """Serve every method on every shared length across all QPS values and write the results:
    :func:`resolve`, then (output directory locked, engine started) :func:`prepare`, :func:`serve`,
    :func:`write`. ``progress``: callback for one-line progress messages (default: dim lines on
    ``console``, the rich Console of the table, default stdout). Returns the summary dict (also
    written to ``output_path/summary.json``). Raises :class:`BenchError` on bad input."""
    from rich.console import Console

    plan = resolve(opts)
    console = console if console is not None else Console()
    say = progress or (lambda msg: console.print(f"[dim]{msg}[/dim]"))
    out_dir = Path(opts.output_path)
    # a busy or unwritable output path fails before the model loads; a server this sweep starts
    # (--engine vllm) stops with it
    with lock_output_dir(out_dir), contextlib.ExitStack() as opened:
        backend = _open_engine(opts, plan.engine_name, opened)
        sweep, config, saved = prepare(opts, plan, backend, say)
        timelines = serve(sweep, backend, saved, config, out_dir / "service.jsonl", say)
        _write_config(out_dir, config, backend)
        return write(out_dir, config, timelines, opts.plots, console if opts.show_table else None)


def resolve(opts: SweepOptions) -> SweepPlan:
    """Check the options, the methods (their knobs, a matched rho, the engine's support) and read a
    trace file, before the output directory is touched or any model loads."""
    names, qps_list = validate(
        opts.methods,
        opts.qps,
        opts.shared_tokens,
        opts.num_trajectories,
        opts.burstiness,
        opts.output_tokens,
        opts.calib_trajectories,
        opts.traces_path is not None,
        opts.warmup_trajectories,
    )
    engine_name = opts.engine if isinstance(opts.engine, str) else opts.engine.name
    matched = parse_matched_rho(opts.matched_rho)
    specs = _method_specs(opts.methods, names, engine_name, opts.engine, matched, opts.method_args)
    needs_calib = _needs_calibration(specs, opts.calib_trajectories, opts.traces_path)
    loaded = None
    if opts.traces_path:
        # every field of every line checked, then what the options ask of the file (its kind, its
        # shared lengths, enough trajectories): a damaged or unsuitable file fails before the model loads
        loaded = load_traces(opts.traces_path)
        _groups_from_file(
            loaded, opts.traces_path, opts.shared_tokens, opts.num_trajectories, opts.accumulated, needs_calib
        )
    return SweepPlan(engine_name, specs, qps_list, matched, needs_calib, loaded)


def prepare(
    opts: SweepOptions, plan: SweepPlan, backend: ServingEngine, say: Callable[[str], None]
) -> tuple[SweepSpec, dict, Measured]:
    """The traces of every shared length (loaded, or built with the engine's tokenizer) with their
    matched-rho schedule, the sweep's configuration, and the output directory opened: checked
    against a resumed sweep's settings (its saved measurements returned), then ``traces.jsonl`` and
    ``config.json`` written."""
    sweep = SweepSpec(
        plan.specs, plan.qps, opts.num_trajectories, opts.burstiness, opts.seed, opts.accumulated, opts.traces_path
    )
    _set_traces(sweep, backend, plan.loaded, plan.needs_calib, opts)
    schedule_groups(sweep, plan.matched, say)
    traces_text = dump_traces(sweep.traces)
    config = sweep_config(sweep, backend, traces_text, opts.method_args or {}, opts.dtype, opts.ignore_eos, opts.warmup)
    config["engine_options"] = dict(opts.engine_options or {})
    config.update(matched_config(sweep, plan.matched))
    out_dir = Path(opts.output_path)
    resumed = (out_dir / "config.json").exists()
    saved = open_dir(out_dir, config, opts.num_trajectories)  # checks the directory before anything is written
    expected = {s: sum(len(t.agents) for t in ev) for s, (ev, _) in sweep.groups.items()}
    sweep.points = {} if backend.replays_service else open_points(out_dir / SERVED, resumed, expected)
    atomic_write(out_dir / "traces.jsonl", traces_text)
    _write_config(out_dir, config, backend)
    return sweep, config, saved


def _method_specs(
    methods: Sequence[str],
    names: list[str],
    engine_name: str,
    backend: ServingEngine | str | None,
    matched: MatchedRho | None,
    method_args: dict | None,
) -> dict[str, MethodSpec]:
    """The methods to serve (``--method all`` on a limited engine: the ones it can run), resolved
    with a matched rho's ``rho`` and checked against the engine, before any model loads."""
    from ..workloads import get_workload

    names = engine_methods(engine_name, methods, names, backend)
    # config.json keeps the user's method_args; the rho a matched rho gives is its own key (matched_rho)
    specs = resolve_methods(names, _matched_method_args(matched, names, method_args), get_workload(TEXT_WORKLOAD))
    _check_support(engine_name, backend, specs)
    return specs


def _check_support(engine_name: str, backend: ServingEngine | str | None, specs: dict[str, MethodSpec]) -> None:
    """Refuse methods the engine cannot run: a registered engine by name (an unknown one too, see
    :func:`~kvcmas_bench.serving.engines.check_engine`), an engine instance by its
    ``why_unsupported``."""
    if isinstance(backend, str) or backend is None:
        check_engine(engine_name, specs)
        return
    why_not = getattr(backend, "why_unsupported", None)
    if why_not is None:
        return
    bad = [n for n, sp in specs.items() if why_not(sp.cls)]
    if bad:
        raise BenchError(f"--engine {engine_name} cannot run {', '.join(bad)}: {why_not(specs[bad[0]].cls)}")


def _needs_calibration(specs: dict[str, MethodSpec], calib_trajectories: int, traces_path: str | None) -> list[str]:
    """The methods that calibrate; built traces must then include calibration trajectories."""
    needs = [n for n, s in specs.items() if s.cls.needs_calibration]
    if needs and calib_trajectories < 1 and traces_path is None:
        raise BenchError(f"{', '.join(needs)} need calibration trajectories (calib_trajectories >= 1)")
    return needs


def _open_engine(opts: SweepOptions, engine_name: str, opened: contextlib.ExitStack) -> ServingEngine:
    """The given engine instance, or the registered engine ``engine_name`` started (the model
    loads), closed when ``opened`` closes."""
    if not isinstance(opts.engine, str):
        return opts.engine
    backend = get_engine(
        engine_name,
        model=opts.model,
        device=opts.device,
        dtype=opts.dtype,
        ignore_eos=opts.ignore_eos,
        warmup=opts.warmup,
        **(opts.engine_options or {}),
    )
    if callable(getattr(backend, "close", None)):
        opened.callback(backend.close)
    return backend


def _set_traces(
    sweep: SweepSpec, backend: ServingEngine, loaded: list[Trace] | None, needs_calib: list[str], opts: SweepOptions
) -> None:
    """``sweep.groups``: the loaded traces (``--traces``) or ones built with the engine's
    tokenizer, per shared length, checked against the model's context and vocabulary."""
    if loaded is not None:
        sweep.groups = _groups_from_file(
            loaded, sweep.traces_path, opts.shared_tokens, sweep.num_trajectories, sweep.accumulated, needs_calib
        )
    else:
        sweep.groups = _built_groups(
            backend.tokenizer,
            opts.shared_tokens,
            sweep.num_trajectories,
            opts.output_tokens,
            sweep.seed,
            sweep.accumulated,
            opts.context_tokens,
            opts.calib_trajectories,
            opts.texts,
            opts.warmup_trajectories,
        )
    check_fits(sweep.traces, backend.max_positions, backend.vocab_size, sweep.traces_path)


def _write_config(out_dir: Path, config: dict, backend: ServingEngine) -> None:
    """``config.json`` with the engine's current description. Written before serving, so that a
    killed sweep resumes its saved measurements (:func:`open_dir` needs it), and again after, with
    the method configurations and the engine state (peak resets) serving added."""
    config["backend_config"] = backend.describe()
    write_json(out_dir / "config.json", config)


def _matched_method_args(matched: MatchedRho | None, names: list[str], method_args: dict | None) -> dict | None:
    """``method_args`` with ``rho = matched.recompute`` for the recomputation methods among ``names``."""
    if matched is None:
        return method_args
    from ..methods import method_class

    args = dict(method_args or {})
    if args.get("rho") is not None:
        raise BenchError(
            "--rho and --matched-rho both set the recomputation methods' rho; give one "
            "(--matched-rho DELTA,RECOMPUTE sets it to RECOMPUTE)"
        )
    if any(rho_role(method_class(n)) == "recompute" for n in names):
        args["rho"] = matched.recompute
    return args


def schedule_groups(sweep: SweepSpec, matched: MatchedRho | None, say: Callable[[str], None]) -> None:
    """Draw the matched-rho schedule of every shared length's evaluated trajectories (the same for
    every method); held-out trajectories (calibration, warm-up) stay unscheduled: calibration needs
    dense observations, and warm-up fills the pools as the method's own gate would. Without a
    matched rho every schedule is cleared (a replayed ``traces.jsonl`` may hold one)."""
    had = any(t.schedule for t in sweep.traces)
    for s, (ev, held) in sweep.groups.items():
        apply_schedule(held, None)
        apply_schedule(ev, None if matched is None else matched.delta, sweep.seed)
        if matched is not None:
            got = scheduled_rho(ev)
            say(
                f"matched rho @ {s} shared tokens: schedule reuses {_share(got['source'])} of the source-eligible "
                f"and {_share(got['reference'])} of the reference-eligible shared tokens "
                f"(target {matched.delta:g}); recomputation rho {matched.recompute:g}"
            )
            if any(x is not None and abs(x - matched.delta) > 0.005 for x in got.values()):
                k = Fraction(1 - matched.delta).limit_denominator(1000).denominator
                say(
                    f"  whole segments cannot reach {matched.delta:g} exactly with {len(ev)} trajectories: the "
                    "first agents' contexts (eligible for KVComm, non-chained KVCMAS, GraphFlow only) are one "
                    f"segment a trajectory; a multiple of {k} trajectories makes them exact"
                )
    if had and matched is None:
        say("the trace file holds a matched-rho schedule; serving without it (give --matched-rho to apply one)")


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def matched_config(sweep: SweepSpec, matched: MatchedRho | None) -> dict:
    """What ``config.json`` records of the matched rho: the targets, the preset, and per shared
    length the schedule's rho per eligibility family and its dense transitions."""
    if matched is None:
        return {"matched_rho": None}
    return {
        "matched_rho": matched.config(),
        "rho_preset": matched.preset,
        "rho_schedule": {
            s: {
                "scheduled_rho": scheduled_rho(ev),
                "dense": dense_transitions(ev),
                "rule": "per stratum (source / reference-only segments), 1 - delta of the nominal shared tokens "
                "dense, seeded by --seed; every other shared segment scheduled reuse",
            }
            for s, (ev, _) in sweep.groups.items()
        },
    }


def serve(
    sweep: SweepSpec,
    backend: ServingEngine,
    saved: Measured,
    config: dict,
    service_path: Path,
    say: Callable[[str], None],
) -> dict[tuple[str, int], dict[float, list[RequestRecord]]]:
    """Every (method, shared length) group: reuse saved measurements where possible, else prepare the
    method on the held-out trajectories and serve the evaluated ones (measurements appended to
    ``service_path``); the served timelines per group and QPS."""
    out = {}
    for s, (ev, cal) in sweep.groups.items():
        schedules = sweep.schedules(len(ev))
        for name, spec in sweep.specs.items():
            prev = saved.get((name, s))
            if (
                backend.replays_service
                and prev is not None
                and [tr[0].trajectory for tr in prev][: len(ev)] == [t.id for t in ev]
            ):
                say(f"{name} @ {s} shared tokens: reusing saved measurements")
                out[(name, s)] = replay_all(prev[: len(ev)], schedules)
                continue
            done = {} if backend.replays_service else _saved_points(sweep.points, name, s, schedules, say)
            # points served by an earlier, interrupted run: said in config.json (their method state
            # was that run's; the rest start from a fresh warm-up)
            if done:
                config.setdefault("resumed_points", []).extend(
                    {"method": name, "shared_tokens": s, "qps": q} for q in done
                )
            if len(done) == len(schedules):
                out[(name, s)] = done
                continue
            say(f"{name} @ {s} shared tokens: preparing (calibration / warm-up on {len(cal)} held-out trajectories)")
            todo = {q: a for q, a in schedules.items() if q not in done}
            res = _serve_group(backend, spec, name, s, cal, ev, todo, config, service_path.parent / SERVED)
            res.timelines = {q: done[q] if q in done else res.timelines[q] for q in schedules}
            if res.service is not None:
                for tr in res.service:
                    for r in tr:
                        r.method, r.shared_tokens = name, s
                    took = sum(r.e2e_s for r in tr)
                    say(f"{name} @ {s}: trajectory {tr[0].trajectory} measured ({took:.2f} s service)")
                _append_service(service_path, res.service)
            for recs in res.timelines.values():
                for r in recs:
                    r.method, r.shared_tokens = name, s
            out[(name, s)] = res.timelines
    return out


def _saved_points(points: Points, name: str, s: int, schedules, say) -> dict[float, list[RequestRecord]]:
    """The QPS points of (``name``, ``s``) a live engine served before this run."""
    done = {q: points[(name, s, float(q))] for q in schedules if (name, s, float(q)) in points}
    if len(done) == len(schedules):
        say(f"{name} @ {s} shared tokens: every QPS point already served (in {SERVED}); not served again")
    elif done:
        say(f"{name} @ {s} shared tokens: QPS {', '.join(f'{q:g}' for q in done)} already served; serving the rest")
    return done


def _serve_group(  # noqa: PLR0913  (one group's inputs and where its points go)
    backend: ServingEngine, spec, name: str, s: int, cal, ev, todo, config: dict, served_path: Path
) -> ServeResult:
    """Prepare the method and serve the ``todo`` points, each appended to ``served_path`` as it
    completes; a lost engine says how much is saved and that a rerun serves the rest."""
    m = backend.prepare(spec, cal)
    config.setdefault("method_configs", {})[name] = m.config()
    config.setdefault("method_resolved", {})[name] = m.resolved(
        _torch_device(str(config.get("device"))), getattr(backend, "kv_width", None)
    )

    def on_point(q: float, recs: list[RequestRecord]) -> None:
        for r in recs:
            r.method, r.shared_tokens, r.qps = name, s, q
        _append_service(served_path, [recs])

    import inspect

    takes = "on_point" in inspect.signature(backend.serve).parameters  # an engine written before it may not
    try:
        return backend.serve(m, ev, todo, on_point=on_point) if takes else backend.serve(m, ev, todo)
    except EngineLost as exc:
        n = len(_read_points(served_path)) if served_path.exists() else 0
        raise BenchError(
            f"{exc}; {n} QPS point(s) finished and are saved in {served_path}; rerun the same command to serve the rest"
        ) from None


def open_points(path: Path, resumed: bool, expected: dict[int, int]) -> Points:
    """A resumed live sweep's complete points (each with every request of its shared length's
    trajectories, ``expected``, once); the file is rewritten without partial points or a torn last
    line. A new sweep starts it empty."""
    if not resumed:
        path.unlink(missing_ok=True)
        return {}
    points = _read_points(path) if path.exists() else {}
    points = {k: v for k, v in points.items() if len(v) == expected.get(k[1])}
    _write_jsonl(path, [r.to_dict() for v in points.values() for r in v])
    return points


def _keyed_records(path: Path, what: str, key: Callable[[RequestRecord], tuple]):
    """``(line, record, key(record))`` for each complete line of ``path``; only a torn last line
    (killed mid-write) is dropped, any other line that is not a ``what`` with that key raises one
    ``BenchError`` naming it."""
    rows, _ = read_jsonl_objects(path)
    for n, _, d in rows:
        try:
            rec = RequestRecord.from_dict(d)
            k = key(rec)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise BenchError(
                f"{path} line {n} is not a {what} ({str(exc)[:200]}); nothing was changed "
                "(repair or remove that line, or use another --output-path)"
            ) from None
        yield n, rec, k


def _read_points(path: Path) -> Points:
    points: Points = {}
    seen: set = set()
    point = lambda r: (str(r.method), int(r.shared_tokens), float(r.qps))  # noqa: E731
    for n, rec, key in _keyed_records(path, "served request", point):
        one = (*key, str(rec.trajectory), rec.step)
        if one in seen:
            raise BenchError(
                f"{path} line {n} repeats request {one[3]} step {one[4]} of a point; use another --output-path"
            )
        seen.add(one)
        points.setdefault(key, []).append(rec)
    return points


def write(out_dir: Path, config: dict, timelines: dict, plots: bool = True, console=None) -> dict:
    """Rows from the served timelines; write requests.jsonl, summary.json, plots; print the table
    (``console`` not None); the summary."""
    served_all = []
    for (method, shared), per_qps in timelines.items():
        for q, served in per_qps.items():
            for r in served:
                r.method, r.shared_tokens, r.qps = method, shared, q
            served_all.extend(served)
    rows = sweep_rows(served_all)
    for row in rows:
        row["rho_target"] = rho_target(config, row["method"])
    _write_jsonl(out_dir / "requests.jsonl", [r.to_dict() for r in served_all])
    summary = {
        "server": config.get("server"),
        "engine": config.get("engine"),
        "qps_unit": QPS_UNIT,
        "qps": list(config["qps"]),
        "burstiness": config["burstiness"],
        "seed": config["seed"],
        "model": config.get("model"),
        "device": config.get("device"),
        "accumulated": config.get("accumulated"),
        "matched_rho": config.get("matched_rho"),
        "rho_preset": config.get("rho_preset"),
        "definitions": DEFINITIONS,
        "rows": rows,
        # saturated points (utilization >= 1: unstable queue) and the QPS NonShared can sustain
        "saturated": [
            {k: r.get(k) for k in ("method", "shared_tokens", "qps", "utilization", "latency_inflation", "drain_ratio")}
            for r in rows
            if r["saturated"]
        ],
        "capacity": capacity(rows),
        "plots": [],
    }
    if plots:
        from ..serving.plots import plot_all, sweep_note

        summary["plots"] = [
            p.name for p in plot_all(rows, out_dir, bool(config.get("accumulated")), sweep_note(summary))
        ]
    write_json(out_dir / "summary.json", summary)
    if console is not None:
        print_sweep_table(summary, console)
    return summary


def evaluate_service(
    output_path: str,
    qps: list[float],
    burstiness: float | None = None,
    seed: int | None = None,
    plots: bool = True,
    console=None,
) -> dict:
    """Re-sweep the measurements saved in ``output_path`` (no model needed) at other QPS values."""
    out_dir = Path(output_path)
    cfg_path = out_dir / "config.json"
    if not cfg_path.exists():
        raise BenchError(f"{out_dir} holds no serve-sweep (config.json missing)")
    with lock_output_dir(out_dir):
        return _evaluate_service(out_dir, _read_config(cfg_path), qps, burstiness, seed, plots, console)


def _evaluate_service(
    out_dir: Path, config: dict, qps: list[float], burstiness: float | None, seed: int | None, plots: bool, console
) -> dict:
    cfg_path = out_dir / "config.json"
    burstiness = config.get("burstiness", 1.0) if burstiness is None else burstiness
    seed = config.get("seed", 0) if seed is None else seed
    _, qps_list = validate(config["methods"], qps, [], 1, burstiness, 1, 0, True)
    measured = _read_service(out_dir / "service.jsonl")
    if not measured:
        raise BenchError(f"{out_dir}/service.jsonl holds no measurements")
    n = config.get("num_trajectories")
    config.update(qps=qps_list, burstiness=burstiness, seed=seed)
    sweep = SweepSpec({}, qps_list, n, burstiness, seed, bool(config.get("accumulated")), None)
    timelines = {
        k: replay_all(v[:n], sweep.schedules(len(v[:n])))
        for k, v in measured.items()
        if k[0] in config["methods"] and k[1] in config["shared_tokens"]
    }
    write_json(cfg_path, config)
    return write(out_dir, config, timelines, plots, console)


# ---- output directory -----------------------------------------------------------------------------
def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    atomic_write(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise BenchError(f"{path} is not valid JSON; use another --output-path") from None
    if not isinstance(config, dict):
        raise BenchError(f"{path} is not a serve-sweep configuration; use another --output-path")
    if "engine" not in config and "backend" in config:  # written before the key was named engine
        config["engine"] = config.pop("backend")
    return config


def _read_service(path: Path) -> Measured:
    """Saved measurements, grouped (method, shared) -> trajectories -> agents. Only a torn last line
    (killed mid-write) is dropped; any other bad line raises ``BenchError`` naming it."""
    groups: dict[tuple[str, int], dict[str, list[RequestRecord]]] = {}
    for _, rec, key in _keyed_records(path, "measured request", lambda r: (str(r.method), int(r.shared_tokens))):
        groups.setdefault(key, {}).setdefault(str(rec.trajectory), []).append(rec)
    return {k: [sorted(v, key=lambda r: r.step or 0) for v in trajs.values()] for k, trajs in groups.items()}


def _append_service(path: Path, service: list[list[RequestRecord]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for tr in service:
            for r in tr:
                f.write(json.dumps(r.to_dict(), default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
