"""The ``ablate`` job: the paper's ablations as resumable sweeps of ordinary run directories.

Kinds (the swept values, ``--values``):

- ``rank``: the base-cache rank r_C (``rank``) and, with ``--delta-ranks``, the delta rank r_D
  (``delta_rank``; every pair); without it r_D = r_C. ``full`` = full-dimensional anchors.

Swept knob values are converted by :func:`~kvcmas_bench.methods.knobs.convert`, as ``--method-arg``
values are (``full`` is the rank knob's word for None); the knobs a sweep sets cannot also be given.
- ``anchors``: the pool size V (V = 1 bypasses the gate).
- ``tau``: the gate threshold under each gate (``--gates paper,scaled``) for every method with a gate
  threshold; methods with a reuse ratio (CacheBlend, DroidSpeak, RelayCaching) run at ``--rhos``
  instead, so that fidelity can be compared at matched rho (paper Table 6 and the Pareto of fidelity
  vs rho).
- ``agents`` (2/4/8) and ``rounds`` (1/2/3): the workflow size, every method (paper Tables 14-15).

Layout: ``DIR/suite.json`` (``"command": "ablate"``: settings, and per point its path, parameters,
status, sample count and error, so that ``report DIR`` reads every point), one run directory per
point (``DIR/<workload>/<point>/``), NonShared over the same samples once per workflow setting (the
reference of agreement), and the results: ``DIR/ablate-<kind>.csv`` and ``.md`` (one row per point)
and ``DIR/figures/``. Re-running the same command resumes: finished points are skipped without
loading a model, a partial one resumes at its first unfinished sample; other settings are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..errors import BenchError, OptionError
from ..methods import METHODS, expand_methods, resolve_method, resolve_methods
from ..methods.knobs import MethodArg, convert, expected
from ..ops.gate import DEFAULT_GATE_TEMPERATURE, GATES
from ..results.frames import read_json
from ..results.outdir import atomic_write, lock_output_dir
from ..results.records import corrupt_input, read_run_files, write_json
from ..results.request import SegmentRecord
from ..settings import EvalSettings, cli, comma_items, comma_list, derive
from ..workloads import get_workload
from .cells import check_cell_process, fresh_cells
from .run import RunOptions, select_samples
from .served import check_served, one_server
from .suite import STRICT_KEYS as SUITE_STRICT_KEYS
from .suite import is_done, resume_manifest, run_cell

KINDS = ("rank", "anchors", "tau", "agents", "rounds")
DEFAULT_VALUES = {
    "rank": "16,32,64",
    "anchors": "1,2,5,10,20",
    "tau": "0.1,0.3,0.5,0.7,0.9",
    "agents": "2,4,8",
    "rounds": "1,2,3",
}
DEFAULT_METHODS = {
    "rank": "kvcmas",
    "anchors": "kvcmas",
    "tau": "kvcmas,kvcomm,cacheblend,droidspeak,relaycaching",
    "agents": "kvcmas,cacheblend",
    "rounds": "kvcmas,cacheblend",
    "chain": "kvcmas,kvcmas-nonchained",
}
DEFAULT_RHOS = (0.6, 0.8, 0.9)
#: the knobs each kind sets per point (not to be given as options too)
SWEPT_KNOBS = {"rank": ("rank", "delta_rank"), "anchors": ("anchors",), "tau": ("tau", "gate_mode", "rho")}
#: settings a resumed ablation directory must share: a suite's, the kind and the topology
STRICT_KEYS = ("kind", *SUITE_STRICT_KEYS, "topology")


@dataclass(kw_only=True)
class AblateOptions(EvalSettings):
    """One ``ablate`` (or ``analyze chain``) sweep (the shared settings:
    :class:`~kvcmas_bench.settings.EvalSettings`)."""

    kind: str
    values: list[str] | None = cli(None, parse=comma_list)
    delta_ranks: list[str] | None = cli(None, parse=comma_list)
    #: ``tau``: the gates (default both) and the reuse ratios of the recomputation methods
    gates: list[str] | None = cli(None, parse=comma_list)
    #: numbers or their text (converted as the ``rho`` knob)
    rhos: list[float | str] | None = cli(None, parse=comma_list)
    methods: list[str] | None = cli(None, parse=comma_list)
    workloads: list[str] = cli(parse=comma_items, factory=lambda: ["mmlu"])
    limit: int | None = 8
    output_path: str = "runs/ablate"
    fidelity: bool = True
    topology: str = "chain"
    #: run NonShared too (the reference of agreement)
    reference: bool = True
    plots: bool = True
    #: where each point runs (as ``suite --cell-process``, :mod:`~kvcmas_bench.jobs.cells`)
    cell_process: str = "auto"

    def settings(self) -> dict:
        return json.loads(json.dumps({k: getattr(self, k) for k in (*STRICT_KEYS, "limit", "device")}))


@dataclass
class Point:
    """One run of the sweep: a method with its options in one workflow setting."""

    workload: str
    name: str
    method: str
    method_args: dict = field(default_factory=dict)
    #: the swept values, as table columns (``{"gate": "scaled", "tau": 0.3}``)
    params: dict = field(default_factory=dict)
    agents: int | None = None
    rounds: int = 1
    #: samples it evaluates
    n: int = 0

    @property
    def cell(self) -> str:
        return f"{self.workload}/{self.name}"


@dataclass
class AblateResult:
    out_dir: Path
    points: list[Point]
    table: pd.DataFrame
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    figures: list = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    #: points whose knob could not act (printed; marked in the table, not drawn)
    notes: list[str] = field(default_factory=list)


def _parse_values(kind: str, values: list, method: str | None = None, knob: str | None = None, flag="--values") -> list:
    """The swept values of ``kind``: knob values converted by the knob converter as ``--method-arg``
    values are (``rank``: ``full`` = None), the workflow sizes (agents, rounds) as integers."""
    out = []
    for v in values:
        if knob is not None:
            cls = METHODS[method]
            try:
                out.append(convert(cls, knob, MethodArg(v.strip(), v.strip(), flag) if isinstance(v, str) else v))
            except OptionError:
                raise BenchError(
                    f"ablate {kind}: {flag} takes comma-separated values, each {expected(cls, knob)}, got {v!r}"
                ) from None
            continue
        try:
            out.append(int(v))
        except ValueError:
            raise BenchError(f"ablate {kind}: {flag} takes comma-separated integers, got {v!r}") from None
    if not out:
        raise BenchError(f"ablate {kind}: no {flag} given")
    return list(dict.fromkeys(out))


def _label(v) -> str:
    return "full" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def sweep_points(opts: AblateOptions, workload: str, methods: list[str]) -> list[Point]:
    """The points of one workload (NonShared references added by :func:`plan_points`)."""
    kind = opts.kind
    if kind == "chain":  # analyze chain: the methods as they are
        return [Point(workload, m, m) for m in methods]
    raw = opts.values or DEFAULT_VALUES.get(kind, "").split(",")
    pts: list[Point] = []
    for m in methods:
        knobs = METHODS[m].knobs()
        if kind in ("rank", "anchors"):
            _need(m, knobs, kind, kind)
            vals = _parse_values(kind, raw, m, kind)
        elif kind == "tau":  # methods without a gate threshold run at --rhos instead
            vals = _parse_values(kind, raw, m, "tau") if "tau" in knobs else []
        else:
            vals = _parse_values(kind, raw)
        if kind == "rank":
            drs = _parse_values(kind, opts.delta_ranks, m, "rank", "--delta-ranks") if opts.delta_ranks else None
            for rc in vals:
                for rd in drs if drs is not None else [rc]:
                    if rd is None and rc is not None:
                        raise BenchError("ablate rank: a full-dimensional delta needs --values full (r_C = r_D = full)")
                    args = {"rank": rc, "delta_rank": None if rd == rc else rd}
                    params = {"r_C": _label(rc), "r_D": _label(rd)}
                    pts.append(Point(workload, f"{m}-r{_label(rc)}-{_label(rd)}", m, args, params))
        elif kind == "anchors":
            pts += [Point(workload, f"{m}-V{v}", m, {"anchors": v}, {"V": v}) for v in vals]
        elif kind == "tau":
            pts += _tau_points(opts, workload, m, knobs, vals)
        else:  # agents, rounds
            for v in vals:
                p = Point(workload, f"{m}-{kind[0].upper()}{v}", m, {}, {kind: v})
                p.agents, p.rounds = (v, 1) if kind == "agents" else (None, v)
                pts.append(p)
    return pts


def _need(method: str, knobs: dict, knob: str, kind: str) -> None:
    if knob not in knobs:
        raise BenchError(f"ablate {kind}: method {method!r} has no option {knob!r}")


def _tau_points(opts: AblateOptions, workload: str, m: str, knobs: dict, taus: list[float]) -> list[Point]:
    """A gated method: every gate x tau; a method with a reuse ratio: every rho; others: one point."""
    gates = opts.gates or list(GATES)
    if "tau" in knobs:
        bad = [g for g in gates if g not in GATES]
        if bad:
            raise BenchError(f"--gates takes {', '.join(GATES)}, got {','.join(gates)!r}")
        return [
            Point(workload, f"{m}-{g}-tau{t:g}", m, {"gate_mode": g, "tau": t}, {"gate": g, "tau": t})
            for g in gates
            for t in taus
        ]
    if "rho" in knobs:
        rhos = _parse_values("tau", opts.rhos or DEFAULT_RHOS, m, "rho", "--rhos")
        return [Point(workload, f"{m}-rho{r:g}", m, {"rho": r}, {"rho": r}) for r in rhos]
    return [Point(workload, m, m, {}, {})]


def plan_points(opts: AblateOptions) -> list[Point]:
    """Check everything and return the points (NonShared first per workflow setting); no model loads."""
    from ..modeling import resolve_device, resolve_dtype

    if opts.kind not in (*KINDS, "chain"):
        raise BenchError(f"unknown ablation {opts.kind!r}; use one of {', '.join(KINDS)}")
    check_cell_process(opts.cell_process, opts.engine)
    for flag, given, kinds in (
        ("--delta-ranks", opts.delta_ranks, ("rank",)),
        ("--gates", opts.gates, ("tau",)),
        ("--rhos", opts.rhos, ("tau",)),
    ):
        if given and opts.kind not in kinds:
            raise BenchError(f"{flag} applies to ablate {', '.join(kinds)}, not {opts.kind}")
    rho_owner = next(n for n, c in METHODS.items() if "rho" in c.knobs())
    for r in _parse_values("tau", opts.rhos, rho_owner, "rho", "--rhos") if opts.rhos else ():
        if r is None or not 0.0 <= r <= 1.0:
            raise BenchError(f"--rhos must lie in [0, 1], got {r}")
    for key in SWEPT_KNOBS.get(opts.kind, ()):
        if opts.method_args.get(key) is not None:
            raise BenchError(
                f"ablate {opts.kind} sets {key!r} at every point (--values, --delta-ranks, --gates, --rhos); "
                "do not give it as an option too"
            )
    methods = [m for m in expand_methods(opts.methods or DEFAULT_METHODS[opts.kind].split(",")) if m != "nonshared"]
    workloads = list(dict.fromkeys(opts.workloads))
    if not workloads:
        raise BenchError("no workloads given (comma-separated, e.g. mmlu,gsm8k)")
    resolve_methods([*methods, "nonshared"], opts.method_args)  # an option no method of the sweep has
    base = _run_options(opts, Point(workloads[0], "x", methods[0] if methods else "nonshared"), Path("."))
    base.validate()
    resolve_device(opts.device)
    resolve_dtype(opts.dtype)
    points: list[Point] = []
    for w in workloads:
        workload = get_workload(w)
        pts = sweep_points(opts, w, methods)
        if opts.reference:
            settings = list(dict.fromkeys((p.agents, p.rounds) for p in pts)) or [(None, 1)]
            refs = [
                Point(w, _ref_name(a, r, opts.kind), "nonshared", {}, _ref_params(a, r, opts.kind), a, r)
                for a, r in settings
            ]
            pts = refs + pts
        n = len(select_samples(workload.load(), opts.limit, opts.seed))
        for p in pts:
            p.n = n
            _check_point(opts, p, workload)
        points += pts
    return points


def _ref_name(agents, rounds, kind: str) -> str:
    if kind == "agents":
        return f"nonshared-A{agents}"
    if kind == "rounds":
        return f"nonshared-R{rounds}"
    return "nonshared"


def _ref_params(agents, rounds, kind: str) -> dict:
    return {"agents": agents} if kind == "agents" else {"rounds": rounds} if kind == "rounds" else {}


def _point_args(opts: AblateOptions, p: Point) -> dict:
    knobs = METHODS[p.method].knobs()
    return {**{k: v for k, v in opts.method_args.items() if k in knobs}, **p.method_args}


def _check_point(opts: AblateOptions, p: Point, workload) -> None:
    """The point's method options and run options, validated as ``run`` would (before any model)."""
    try:
        spec = resolve_method(p.method, _point_args(opts, p), workload)
    except BenchError as exc:
        raise BenchError(f"ablate {opts.kind} point {p.cell}: {exc}") from None
    if opts.engine == "vllm":
        check_served(opts, workload, {p.method: spec})
    _run_options(opts, p, Path(opts.output_path)).validate()


def _run_options(opts: AblateOptions, p: Point, out_dir: Path) -> RunOptions:
    return derive(
        RunOptions,
        opts,
        EvalSettings,
        method=p.method,
        workload=p.workload,
        output_path=str(out_dir / p.workload / p.name),
        topology=opts.topology,
        agents=p.agents,
        rounds=p.rounds,
        method_args=_point_args(opts, p),
    )


def open_manifest(out_dir: Path, opts: AblateOptions, points: list[Point]) -> dict:
    """The manifest of ``out_dir``, new or resumed (refused when its settings differ)."""
    settings = opts.settings()
    _, cells = resume_manifest(out_dir, "ablate", settings, STRICT_KEYS)
    for p in points:
        cells.setdefault(p.cell, {"path": p.cell, "status": "pending"})
        cells[p.cell].update(workload=p.workload, method=p.method, params=p.params, agents=p.agents, rounds=p.rounds)
    return {"command": "ablate", "kind": opts.kind, "settings": settings, "cells": cells}


def run_ablation(opts: AblateOptions, progress=None) -> AblateResult:
    """Run (or resume) every point, then tabulate and plot; returns what ran, was skipped or failed.

    ``progress``: optional object as for ``suite`` (``begin``, ``cell``, ``end_cell``)."""
    points = plan_points(opts)
    with lock_output_dir(opts.output_path) as out_dir:  # one ablation per directory at a time
        res = _run_points(opts, points, out_dir, progress)
        if opts.kind in KINDS and not res.table.empty:
            write_outputs(res, opts.kind, opts.plots)
    return res


def _run_points(opts: AblateOptions, points: list[Point], out_dir: Path, progress) -> AblateResult:
    manifest = open_manifest(out_dir, opts, points)
    write_json(out_dir / "suite.json", manifest)
    cells = [_Cell(p.cell, p.n) for p in points]
    res = AblateResult(out_dir, points, pd.DataFrame())
    res.skipped = [p.cell for p in points if is_done(manifest["cells"][p.cell], p.n)]
    if progress is not None:
        progress.begin(cells, set(res.skipped))
    fresh = fresh_cells(opts.cell_process, opts.engine, opts.device)
    with one_server(opts, start=any(p.cell not in res.skipped for p in points)):
        for p, c in zip(points, cells):
            if p.cell not in res.skipped:
                ro = _run_options(opts, p, out_dir)
                run_cell(p.cell, ro, manifest, out_dir, res.failed, progress, c, fresh=fresh)
    if len(res.failed) < len(points):
        res.table = ablation_table(out_dir, [p for p in points if p.cell not in res.failed] + earlier(manifest, points))
    return res


def earlier(manifest: dict, points: list[Point]) -> list[Point]:
    """Finished points of earlier invocations into the same directory (other values or methods),
    so that the table and figures cover everything the directory holds."""
    current = {p.cell for p in points}
    out = []
    for name, c in manifest["cells"].items():
        if name in current or c.get("status") != "done" or "method" not in c:
            continue
        w, _, point = str(c.get("path", name)).partition("/")
        out.append(Point(w, point, c["method"], {}, dict(c.get("params") or {}), c.get("agents"), c.get("rounds", 1)))
    return out


@dataclass
class _Cell:
    name: str
    n: int


def ablation_table(out_dir: Path, points: list[Point]) -> pd.DataFrame:
    """One row per point: its parameters, Table 1 figures (accuracy, agreement with NonShared, rho,
    KV error, TTFT, latency, memory) and generated tokens per second of E2E time."""
    from ..report.tables import METHOD_ORDER, agreement, reference_for, run_metrics
    from ..results.frames import load_dirs

    results = load_dirs([out_dir])
    by_path = {r.path.resolve(): r for r in results.runs}
    rows = []
    for p in points:
        run = by_path.get((out_dir / p.workload / p.name).resolve())
        if run is None:
            continue
        row = {"workload": p.workload, "point": p.name, "method": p.method, **p.params}
        row.update(model=run.config.get("model"), device=run.config.get("device"))
        row.update(run_metrics(run))
        row.update(agreement(run, reference_for(run, results.runs)))
        row["throughput_tok_s"] = _throughput(run)
        row["gate_accept_share"] = _accept_share(out_dir / p.workload / p.name)
        row["exercised"] = _exercised(run)
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    df["_m"] = df["method"].map(lambda m: order.get(m, len(order)))
    df["_w"] = df["workload"].map({w: i for i, w in enumerate(dict.fromkeys(df["workload"]))})
    return df.sort_values(["_w", "_m"], kind="stable").drop(columns=["_w", "_m"]).reset_index(drop=True)


def _exercised(run) -> bool | None:
    """Whether an online correction method corrected at least one segment, i.e. whether its knobs
    could act at this point at all (:func:`kvcmas_bench.reproduce.facts.exercised`); None for the
    other methods."""
    from ..reproduce.facts import exercised

    return exercised(run.method, run.requests)


def _throughput(run) -> float | None:
    s, r = run.samples, run.requests
    if s.empty or r.empty or "latency_s" not in s:
        return None
    total = float(s["latency_s"].sum())
    return float(r["output_tokens"].sum()) / total if total > 0 else None


def _gated_segments(run_dir: Path) -> list[SegmentRecord]:
    """The segments of a run's finished samples whose gate compared anchors, read by the run
    directory readers (:func:`~kvcmas_bench.results.records.read_run_files`)."""
    config = read_json(run_dir / "config.json") if (run_dir / "config.json").exists() else None
    _, _, records, _ = read_run_files(run_dir / "samples.jsonl", run_dir / "requests.jsonl", config, corrupt_input)
    return [s for r in records for s in r.segments if s.gate is not None and s.gate.compared]


def _accept_share(run_dir: Path) -> float | None:
    """Share of gated tokens (segments whose gate compared anchors: ``GateOutcome.compared``) that
    the gate accepted."""
    gated = _gated_segments(run_dir)
    tot = sum(s.tokens for s in gated)
    acc = sum(s.tokens for s in gated if s.gate.accepted)
    return acc / tot if tot else None


def write_outputs(res: AblateResult, kind: str, plots: bool = True) -> None:
    """``ablate-<kind>.csv`` and ``.md`` (one table per workload) and the figures: each metric vs the
    swept value, and for ``tau`` the Pareto of fidelity vs measured rho."""
    from ..analysis.ablation import pareto_figure, sweep_figure, table_columns
    from ..report.plots import save
    from ..report.render import Document, Section, markdown

    df, out = res.table, res.out_dir
    res.files.append(out / f"ablate-{kind}.csv")
    atomic_write(res.files[-1], df.to_csv(index=False))
    sections = []
    for w, g in df.groupby("workload", sort=False):
        meta = (
            f"{', '.join(sorted({str(m) for m in g['model']}))} on {', '.join(sorted({str(d) for d in g['device']}))}"
        )
        idle = g["exercised"].eq(False) if "exercised" in g else pd.Series(False, index=g.index)
        notes = []
        if idle.any():
            names = ", ".join(str(x) for x in g.loc[idle, "point"])
            notes.append(
                f"not exercised (no segment corrected: the anchor pools never filled; not drawn as results): {names}; "
                "add --warmup N or raise --limit"
            )
            res.notes.append(f"{w}: {notes[-1]}")
        sections.append(
            Section(
                f"ablate {kind}: {w} ({meta}; n = {int(g['n'].max())})",
                table_columns(kind, g),
                g.to_dict("records"),
                notes=notes,
            )
        )
        if not plots or (idle.any() and not g.loc[~idle, "exercised"].eq(True).any()):
            continue  # no point of an online method acted: nothing to draw
        g = g[~idle]
        fig, _ = sweep_figure(g, kind, f"ablate {kind}: {w} ({meta})")
        res.figures.append(save(fig, out / "figures", f"{w}_{kind}", f"{w}: metrics vs {kind}"))
        if kind == "tau":
            fig, _ = pareto_figure(g, f"{w}: fidelity vs measured rho ({meta})")
            res.figures.append(save(fig, out / "figures", f"{w}_tau_pareto", f"{w}: fidelity vs rho at matched rho"))
            res.figures += _replay(out, g, w)
    doc = Document(f"kvcmas-bench ablate {kind}", [f"ablation directory: {out}"], sections, res.figures, DEFINITIONS)
    res.files.append(out / f"ablate-{kind}.md")
    atomic_write(res.files[-1], markdown(doc, out))


DEFINITIONS = [
    "agree w/ NonShared: share of samples whose final answer equals NonShared's over the same samples "
    "(an unparsed answer agrees with nothing; first-token agree: per request).",
    "rho: (token, layer) entries served by reuse / reuse-eligible shared entries (summary.json definitions).",
    "gated tokens accepted: share of the tokens of segments whose gate compared anchors that it accepted "
    "(segments with fewer than two compatible anchors are dense and not gated).",
    "KV rel. error: ||C - C_dense|| / ||C_dense|| over K and V, mean over every shared segment (with --fidelity).",
    "tok/s: generated tokens / E2E time, over all samples.",
]


def recorded_decisions(run_dir: Path) -> list[tuple[list[float], int]]:
    """Every gate decision of a run that compared anchors: its distances and the segment's tokens."""
    return [
        (list(s.details["distances"]), int(s.tokens)) for s in _gated_segments(run_dir) if s.details.get("distances")
    ]


def _replay(out: Path, g: pd.DataFrame, workload: str) -> list:
    """``gate-replay-<workload>.csv`` and its figure: both gates' accepted share vs tau, replayed on
    every gate decision the workload's gated points recorded (what tau does to the same decisions)."""
    from ..analysis.ablation import replay_figure, replay_frame
    from ..report.plots import save

    gated = g[g["method"].map(lambda m: "tau" in METHODS[m].knobs())]
    decisions = [d for p in gated["point"] for d in recorded_decisions(out / workload / p)]
    if not decisions:
        return []
    temps = {
        read_json(out / workload / p / "config.json")["method_config"].get("gate_temperature") for p in gated["point"]
    }
    temp = next(iter(temps)) if len(temps) == 1 and None not in temps else DEFAULT_GATE_TEMPERATURE
    df = replay_frame(decisions, [i / 40 for i in range(41)], temp)
    atomic_write(out / f"gate-replay-{workload}.csv", df.to_csv(index=False))
    title = f"{workload}: {len(decisions)} recorded gate decisions replayed (scaled gate_temperature {temp:g})"
    fig, _ = replay_figure(df, title)
    return [save(fig, out / "figures", f"{workload}_gate_replay", f"{workload}: accepted share vs tau, both gates")]
