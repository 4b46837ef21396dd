"""The ``suite`` job: a matrix of methods x workloads, one resumable run directory per cell, and the
report over all of them at the end.

Layout: ``DIR/suite.json`` (the manifest: settings, methods, workloads, and per cell its path,
status, sample count and error), ``DIR/<workload>/<method>/`` (an ordinary ``run`` directory) and
``DIR/report/`` (the ``report`` job over ``DIR``). With ``--repeats N`` every cell runs N times:
repeat r with seed ``--seed`` + r (another sample subset under ``--limit``, another sample order
and calibration split); repeat 0 is the cell above, repeat r >= 1 is
``DIR/repeat-<r>/<workload>/<method>/``. The report then has one Table 1 per seed and the mean and
standard deviation of each method's accuracy across the repeats.

Policy:

- Everything is checked before any model loads: job options, the methods and every method
  option for every workload (an option no selected method has is an error), each workload's data
  (loaded once to count the samples) and, for methods that calibrate, that held-out samples remain.
- Every cell runs the ``run`` job with the same ``--seed``/``--limit``: the same samples for every
  method. NonShared is always included, first in each workload: it is the reference of agreement.
  Method options go to the methods that have them.
- A cell that fails with a user-facing error (:class:`BenchError`, e.g. a method that cannot run
  this model) is recorded in ``suite.json`` with its message and the other cells still run; the
  report covers the finished cells and the command then exits with code 2 naming the failed cells.
  Other exceptions (bugs) stop the suite.
- Ctrl-C keeps every finished sample. The same command resumes: cells recorded as done (same
  sample count) are skipped without loading a model; the interrupted cell resumes at its first
  unfinished sample. A different ``--limit`` re-enters every cell (each resumes its samples);
  different model, dtype, seed, token budgets, fidelity or method options are refused. More
  ``--repeats`` add cells (the repeats already done are kept).
- ``--shard K/N`` runs the K-th of N disjoint slices of the cell list (cells ``i`` with
  ``i % N == K - 1`` in plan order, NonShared first per workload as always), so a cluster's job
  array can run one suite on N machines, each into its own directory. The manifest records the
  shard and the whole plan (:func:`plan_id`: its cells and the settings that change results);
  ``report`` and ``compare`` merge shard directories into one suite, refusing (one line) shards of
  different plans... given twice, missing, or beside the unsharded suite of the same plan
  (:func:`~kvcmas_bench.results.frames.check_shards`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import BenchError
from ..methods import METHODS, expand_methods, resolve_methods
from ..results.frames import plan_id, read_json
from ..results.outdir import lock_output_dir
from ..results.records import write_json
from ..settings import EvalSettings, cli, comma_items, derive
from ..workloads import get_workload
from .cells import check_cell_process, fresh_cells, plugins, run_in_fresh_process
from .run import RunOptions, check_sandbox, select_samples
from .run import run as run_job
from .served import check_served, one_server

#: settings a resumed suite directory must share (they change every result)
STRICT_KEYS = (
    "model",
    "dtype",
    "seed",
    "max_new_tokens",
    "final_max_new_tokens",
    "fidelity",
    "calib_samples",
    "method_args",
)


@dataclass(kw_only=True)
class SuiteOptions(EvalSettings):
    """One ``suite``: methods x workloads (the shared settings: :class:`~kvcmas_bench.settings.EvalSettings`)."""

    methods: list[str] = cli(parse=comma_items, factory=lambda: ["all"])
    workloads: list[str] = cli(parse=comma_items, factory=lambda: ["mmlu"])
    output_path: str = "runs/suite"
    report_formats: list[str] = cli(
        source="report_format", parse=comma_items, flag="--format", factory=lambda: ["md", "html"]
    )
    plots: bool = True
    #: runs of every cell, repeat r with seed ``seed + r``
    repeats: int = 1
    #: ``(K, N)``: run only the K-th of N disjoint slices of the cells (``--shard K/N``)
    shard: tuple[int, int] | None = cli(None, parse=lambda flag, v: parse_shard(flag, v))
    #: where each cell runs: ``fresh`` (a new process), ``same`` (this one), ``auto`` (fresh on CPU),
    #: see :mod:`~kvcmas_bench.jobs.cells`
    cell_process: str = "auto"

    def settings(self) -> dict:
        keys = (*STRICT_KEYS, "limit", "device", *(("repeats",) if self.repeats != 1 else ()))
        return json.loads(json.dumps({k: getattr(self, k) for k in keys}))


@dataclass
class Cell:
    workload: str
    method: str
    #: samples the cell evaluates
    n: int
    #: the repeat (seed offset); repeat 0 is the suite's own cell
    repeat: int = 0
    #: samples in flight of this cell when not the suite's (the noise floor's NonShared at 1)
    max_concurrency: int | None = None

    @property
    def name(self) -> str:
        cell = f"{self.workload}/{self.method}" + (f"-c{self.max_concurrency}" if self.max_concurrency else "")
        return cell if self.repeat == 0 else f"repeat-{self.repeat}/{cell}"


@dataclass
class SuiteResult:
    out_dir: Path
    cells: list[Cell]
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    report: object = None


def parse_shard(flag: str, value) -> tuple[int, int] | None:
    """``K/N`` (1 <= K <= N) as ``(K, N)``; one line otherwise."""
    if value is None or isinstance(value, tuple):
        return value
    k, sep, n = str(value).partition("/")
    if not sep or not k.strip().isdigit() or not n.strip().isdigit() or not 1 <= int(k) <= int(n):
        raise BenchError(f"{flag} must be K/N with 1 <= K <= N (the K-th of N slices), got {value!r}")
    return int(k), int(n)


def shard_cells(cells: list[Cell], shard: tuple[int, int] | None) -> list[Cell]:
    """The cells of shard ``(K, N)``: every N-th cell of the plan from the K-th on (all: None)."""
    if shard is None:
        return cells
    k, n = shard
    mine = [c for i, c in enumerate(cells) if i % n == k - 1]
    if not mine:
        raise BenchError(f"--shard {k}/{n}: the suite has {len(cells)} cells, so shard {k} would be empty")
    return mine


def run_options(opts: SuiteOptions, cell: Cell) -> RunOptions:
    """The ``run`` options of one cell (method options filtered to the method's own knobs)."""
    knobs = METHODS[cell.method].knobs()
    return derive(
        RunOptions,
        opts,
        EvalSettings,
        method=cell.method,
        workload=cell.workload,
        output_path=str(Path(opts.output_path) / cell.name),
        seed=opts.seed + cell.repeat,
        max_concurrency=cell.max_concurrency or opts.max_concurrency,
        method_args={k: v for k, v in opts.method_args.items() if k in knobs},
    )


def plan_suite(opts: SuiteOptions) -> list[Cell]:
    """Check everything and return the cells, NonShared first in each workload; no model is loaded."""
    from ..modeling import resolve_device, resolve_dtype

    if isinstance(opts.repeats, bool) or not isinstance(opts.repeats, int) or opts.repeats < 1:
        raise BenchError(f"--repeats must be a whole number >= 1, got {opts.repeats!r}")
    check_cell_process(opts.cell_process, opts.engine)
    methods = expand_methods(opts.methods)
    if opts.engine == "vllm" and "all" in opts.methods:  # all that the engine runs (named ones are checked)
        from ..serving.vllm.http import why_not_http

        methods = [m for m in methods if not why_not_http(METHODS[m])]
    methods = ["nonshared"] + [m for m in methods if m != "nonshared"]
    workloads = list(dict.fromkeys(opts.workloads))
    if not workloads:
        raise BenchError("no workloads given (comma-separated, e.g. mmlu,gsm8k)")
    run_options(opts, Cell(workloads[0], methods[0], 0)).validate()  # job options: limit, token budgets...
    check_sandbox(workloads, opts.unsafe_sandbox)
    resolve_device(opts.device)
    resolve_dtype(opts.dtype)
    sizes = {}
    for w in workloads:
        workload = get_workload(w)
        specs = resolve_methods(methods, opts.method_args, workload)
        if opts.engine == "vllm":
            check_served(opts, workload, specs)
        data = workload.load()
        n = len(select_samples(data, opts.limit, opts.seed))  # the same for every seed
        if n == 0:
            raise BenchError(f"workload {w!r} has no samples")
        calibrating = [m for m, s in specs.items() if s.cls.needs_calibration]
        if calibrating and len(data) - n < 1:
            raise BenchError(f"{', '.join(calibrating)} need held-out calibration samples on {w}; lower --limit")
        sizes[w] = n
    # repeat by repeat: an interrupted suite has whole repeats done first
    # on a batching engine, NonShared once more one sample at a time: the noise floor of every agreement
    floor = [1] if opts.engine == "vllm" and opts.max_concurrency > 1 else []
    return [
        cell
        for r in range(opts.repeats)
        for w in workloads
        for cell in [Cell(w, m, sizes[w], r) for m in methods] + [Cell(w, "nonshared", sizes[w], r, c) for c in floor]
    ]


def resume_manifest(out_dir: Path, command: str, settings: dict, strict_keys: tuple) -> tuple[dict, dict]:
    """The previous manifest of a matrix job in ``out_dir`` (``{}`` when new) and its cell states.

    Refused (one line) when the directory holds another command's manifest or one whose
    ``strict_keys`` settings differ; a changed ``--limit`` sends every cell back to pending."""
    path = out_dir / "suite.json"
    old = read_json(path) if path.exists() else None
    if old is None:
        return {}, {}
    label = "an ablation" if command == "ablate" else f"a {command}"
    if old.get("command") != command:
        raise BenchError(f"{path} is not {label} manifest; use another --output-path")
    prev = old.get("settings", {})
    for k in strict_keys:
        if prev.get(k) != settings[k]:
            raise BenchError(
                f"{out_dir} holds {label} with a different {k} ({prev.get(k)!r} vs {settings[k]!r}); "
                "use another --output-path"
            )
    states = dict(old.get("cells", {}))
    if prev.get("limit") != settings["limit"]:
        states = {k: {**v, "status": "pending"} for k, v in states.items()}
    return old, states


def open_manifest(out_dir: Path, opts: SuiteOptions, cells: list[Cell], planned: list[Cell] | None = None) -> dict:
    """The manifest of ``out_dir``, new or resumed (refused when its settings differ). ``planned``:
    a shard's whole plan (``cells`` are its own)."""
    settings = opts.settings()
    old, states = resume_manifest(out_dir, "suite", settings, STRICT_KEYS)
    shard = None
    if opts.shard is not None:
        names = [c.name for c in planned or cells]
        shard = {"index": opts.shard[0], "count": opts.shard[1], "plan": plan_id(settings, names), "cells": names}
    if old and old.get("shard") != shard:
        had = old.get("shard")
        what = f"shard {had['index']}/{had['count']}" if isinstance(had, dict) else "the whole suite"
        raise BenchError(f"{out_dir} holds {what} of a suite; use another --output-path")
    for c in cells:
        state = {"workload": c.workload, "method": c.method, "path": c.name, "status": "pending"}
        if c.repeat:
            state.update(repeat=c.repeat, seed=opts.seed + c.repeat)
        states.setdefault(c.name, state)
    return {
        "command": "suite",
        "settings": settings,
        "methods": list(dict.fromkeys([*old.get("methods", []), *(c.method for c in cells)])),
        "workloads": list(dict.fromkeys([*old.get("workloads", []), *(c.workload for c in cells)])),
        "cells": states,
        **({"shard": shard} if shard else {}),
    }


def is_done(state: dict, n: int) -> bool:
    """A cell finished earlier over the same ``n`` samples (a changed --limit reruns it)."""
    return state.get("status") == "done" and state.get("n") == n


def run_suite(opts: SuiteOptions, progress=None) -> SuiteResult:
    """Run (or resume) every cell, then write the report; returns what ran, was skipped or failed.

    ``progress``: optional object with ``begin(cells, done)``, ``cell(cell) -> run progress``
    (``start``/``advance`` as for ``run``) and ``end_cell(cell, status, detail)``.
    """
    from .report import parse_formats

    parse_formats(opts.report_formats)
    cells = plan_suite(opts)
    with lock_output_dir(opts.output_path) as out_dir:  # one suite per directory at a time
        return _run_cells(opts, cells, out_dir, progress)


def _run_cells(opts: SuiteOptions, planned: list[Cell], out_dir: Path, progress) -> SuiteResult:
    from .report import build_report

    cells = shard_cells(planned, opts.shard)
    manifest = open_manifest(out_dir, opts, cells, planned)
    write_json(out_dir / "suite.json", manifest)
    res = SuiteResult(out_dir, cells, skipped=[c.name for c in cells if is_done(manifest["cells"][c.name], c.n)])
    if progress is not None:
        progress.begin(cells, set(res.skipped))
    fresh = fresh_cells(opts.cell_process, opts.engine, opts.device)
    with one_server(opts, start=any(c.name not in res.skipped for c in cells)):
        for cell in cells:
            if cell.name not in res.skipped:
                ro = run_options(opts, cell)
                run_cell(cell.name, ro, manifest, out_dir, res.failed, progress, cell, fresh=fresh)
    if len(res.failed) < len(cells):
        res.report = build_report([out_dir], out_dir / "report", opts.report_formats, opts.plots)
    return res


def run_cell(
    name: str, ro: RunOptions, manifest: dict, out_dir: Path, failed: dict, progress, cell, fresh: bool = False
) -> None:
    """Run one matrix cell (suite or ablation) through ``run``, in a fresh process when ``fresh``; its
    state in the manifest goes running -> done or failed and is saved before and after, with where it
    ran (``process``: fresh or same). ``cell`` is what ``progress`` shows."""
    extra = plugins(ro) if fresh else None  # None: this process (also for a class defined in __main__)
    state = manifest["cells"][name]
    run_opts = json.loads(json.dumps(asdict(ro), default=str))
    state.update(status="running", error=None, run_options=run_opts, process="same" if extra is None else "fresh")
    write_json(out_dir / "suite.json", manifest)
    shown = progress.cell(cell) if progress is not None else None
    try:
        summary = run_job(ro, progress=shown) if extra is None else run_in_fresh_process(ro, extra, progress=shown)
    except BenchError as exc:
        state.update(status="failed", error=str(exc))
        failed[name] = str(exc)
        if progress is not None:
            progress.end_cell(cell, "failed", str(exc))
    else:
        state.update(status="done", n=summary.get("n"), accuracy=summary.get("accuracy"))
        if progress is not None:
            progress.end_cell(cell, "done", summary)
    write_json(out_dir / "suite.json", manifest)
