"""Console tables of the jobs (rich), readable at 80 columns.

Every table is built by :func:`fitted_table`: compact layout, units in the headers or the title,
and the least important columns dropped until the table's minimum width fits the console, so no
cell is ever cut to an ellipsis. The full figures are in the output files (named in the caption).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from .registry import LiveSequence
from .report.columns import Column, cell, figure_columns


def fmt(v, unit: str = "") -> str:
    """A table cell: ``-`` for missing values, MiB for bytes, 3 decimals for seconds."""
    return cell(v, {"B": "MiB", "s": "s"}.get(unit, "num"))


def _build(title: str, cols: Sequence[Column], rows: Sequence[dict], caption: str | None) -> Table:
    t = Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title_justify="left",
        caption_justify="left",
    )
    for c in cols:
        t.add_column(c.header, justify=c.justify, overflow="fold")
    for r in rows:
        t.add_row(*[cell(r.get(c.key), c.kind) for c in cols])
    return t


def _column_ranges(console: Console, table: Table) -> list:
    """Each column's (minimum, maximum) width with padding: minimum = its longest word."""
    options = console.options.update_width(10_000)
    return [table._measure_column(console, options, c) for c in table.columns]


def min_width(console: Console, table: Table) -> int:
    """The width below which some cell of ``table`` would be cut: every column at its longest word.
    (``Measurement.get`` of a table is capped at the console width, so it cannot tell.)"""
    return sum(r.minimum for r in _column_ranges(console, table)) + table._extra_width


def _fix_widths(console: Console, table: Table, width: int) -> None:
    """When ``table`` does not fit naturally, fix its column widths: every column at least its
    longest word, the spare width to the columns that need it most (rich's own collapse may cut a
    column below its longest word)."""
    ranges = _column_ranges(console, table)
    avail = width - table._extra_width
    if sum(r.maximum for r in ranges) <= avail:
        return
    widths = [r.minimum for r in ranges]
    for _ in range(max(0, avail - sum(widths))):
        need = [r.maximum - w for r, w in zip(ranges, widths)]
        i = max(range(len(widths)), key=lambda j: need[j])
        if need[i] <= 0:
            break
        widths[i] += 1
    for i, (col, w) in enumerate(zip(table.columns, widths)):
        col.width = max(1, w - table._get_padding_width(i))


def fitted_table(
    console: Console,
    title: str,
    columns: Sequence[Column],
    rows: Sequence[dict],
    caption: str | None = None,
    more: str | None = None,
) -> Table:
    """A table of ``rows`` (dicts keyed by the columns' keys) that fits ``console.width``: columns of
    the highest priority number are dropped first (priority 0 never). ``more``: where the dropped
    columns can be found, added to the caption when some were dropped."""
    keep = list(columns)
    while True:
        note = caption
        dropped = [c.header for c in columns if c not in keep]
        if dropped and more:
            note = ((caption + "\n") if caption else "") + f"{len(dropped)} more columns in {more}"
        t = _build(title, keep, rows, note)
        droppable = [c for c in keep if c.priority > 0]
        if min_width(console, t) <= console.width or not droppable:
            _fix_widths(console, t, console.width)
            return t
        worst = max(c.priority for c in droppable)
        keep.remove([c for c in droppable if c.priority == worst][-1])


#: the ``run`` console table: every figure with a ``console`` view (:mod:`kvcmas_bench.results.figures`)
RUN_COLUMNS = LiveSequence(lambda: figure_columns("console"))


def print_run_summary(summary: dict, console: Console) -> None:
    title = f"{summary['method']} on {summary['workload']} ({summary.get('model')}, {summary.get('device', '?')})"
    console.print(fitted_table(console, title, RUN_COLUMNS, [summary], more="summary.json"))
    line = accounting_line(summary.get("accounting") or {})
    if line:
        console.print(line)
    for w in summary.get("warnings") or []:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    if "fidelity" in summary:
        f = summary["fidelity"]
        console.print(
            f"fidelity: top-1 agreement {fmt(f.get('top1_agree'))}, first-token KL "
            f"{fmt(f.get('first_token_kl'))}, relative KV error vs full dense prefill {fmt(f.get('kv_rel_error'))} "
            f"(all {f.get('segments', '?')} shared segments)"
        )
        per = [fmt(a.get("kv_rel_error")) for a in f.get("per_agent", [])]
        if per:
            console.print(f"  KV error per agent, in execution order: {' / '.join(per)}")
    pool = (summary.get("method_state") or {}).get("total")
    if pool and pool.get("anchors"):
        console.print(
            f"anchor pools: {pool['anchors']} anchors, {pool['entries']} entries; "
            f"{pool['bytes_per_anchor'] / 2**20:.2f} MiB per anchor, "
            f"{pool['bytes_per_entry'] / 2**20:.2f} MiB per entry"
        )


ACCOUNTING_LABELS = (
    ("accepted", "accepted"),
    ("dense_fallback", "dense fallbacks"),
    ("nonfinite_fallback", "non-finite"),
    ("corrected", "corrected"),
    ("uncalibrated", "uncalibrated"),
    ("anchors_inserted", "anchors +"),
    ("entries_inserted", "entries +"),
    ("anchors_evicted", "anchors -"),
)


def accounting_line(acc: dict) -> str:
    """One line of a method's key counters (empty for methods that count nothing)."""
    parts = [f"{label} {acc[k]}" for k, label in ACCOUNTING_LABELS if acc.get(k)]
    ent = acc.get("gate_entropy") or {}
    if ent.get("n"):
        parts.append(f"gate entropy p50 {fmt(ent['p50'])} (n {ent['n']})")
    segs = acc.get("segments") or {}
    if segs:
        parts.append("segments " + ", ".join(f"{k} {v}" for k, v in sorted(segs.items())))
    return ("method: " + "; ".join(parts)) if parts else ""


#: the columns naming a sweep point
POINT_COLUMNS = (
    Column("method", "method", "text", 0, "left"),
    Column("shared_tokens", "shared tokens", "int", 1),
    Column("qps", "QPS", "num", 0),
)
#: the serve-sweep table: the point, its utilization, then every figure with a ``sweep`` view
SWEEP_COLUMNS = LiveSequence(lambda: figure_columns("sweep", (*POINT_COLUMNS, Column("util_cell", "util", "raw", 0))))


#: where each point's TTFT goes: the columns of :func:`kvcmas_bench.serving.metrics.ttft_breakdown`
TTFT_SPLIT_COLUMNS = LiveSequence(lambda: figure_columns("ttft_split", POINT_COLUMNS))
TTFT_SPLIT_NOTE = (
    "TTFT pXX = svc + queue, the parts of the request(s) at that rank. svc: the request's own service (svc dense: "
    "its shared segments prefilled densely; svc reuse: reused/corrected/recomputed ones incl. gate and reference; "
    "the rest: private prefill, first token). q behind dense: queueing while the server served a request that "
    "prefilled a reuse-eligible shared segment densely (a dense fallback); its share of all queueing last."
)


def saturation_note(summary: dict) -> str | None:
    """The caption line on saturated points and the QPS NonShared sustains (None when none)."""
    sat = [r for r in summary["rows"] if r.get("saturated")]
    cap = summary.get("capacity") or {}
    if not sat:
        return None
    offered = [r for r in sat if r.get("utilization") is not None]
    if offered:
        worst = max(offered, key=lambda r: r["utilization"])
        text = (
            f"! saturated: {len(sat)} of {len(summary['rows'])} points offer load >= 1 (up to "
            f"{worst['utilization']:.1f}x what the server serves); the queue grows without bound and their "
            "percentiles grow with the trace length."
        )
    else:
        text = (
            f"! saturated: at {len(sat)} of {len(summary['rows'])} points the server falls behind the offered rate "
            "(util column marked *)."
        )
    for shared, c in cap.items():
        if c.get("nonshared_capacity_qps") is None and c.get("nonshared_max_stable_qps") is not None:
            text += f" NonShared keeps up at {c['nonshared_max_stable_qps']:g} QPS at {shared} shared tokens."
    for shared, c in cap.items():
        if c.get("nonshared_capacity_qps") is not None:
            text += f" NonShared sustains < {c['nonshared_capacity_qps']:.3g} QPS at {shared} shared tokens"
            if c.get("nonshared_max_stable_qps") is not None:
                text += f" (highest stable QPS swept: {c['nonshared_max_stable_qps']:g})"
            text += "."
    return text


def _served(row: dict) -> bool:
    """A point served for real (no isolated service times): its util column is estimated."""
    return bool(row.get("utilization_basis") or (row.get("utilization") is None and row.get("drain_ratio")))


def print_sweep_table(summary: dict, console: Console) -> None:
    rows = []
    for r in summary["rows"]:
        star = "*" if _served(r) else ""
        if r.get("utilization") is not None:
            u = f"{r['utilization']:.2f}{star}"
        elif r.get("drain_ratio") is not None:  # served for real without a single-stream point
            u = f"{r['drain_ratio']:.2f}{star}"
        else:
            u = "-"
        rows.append({**r, "util_cell": f"[bold red]{u}![/]" if r.get("saturated") else u})
    title = (
        f"serve-sweep, TTFT in s under load ({summary.get('model')}; {summary.get('device', '?')}; engine "
        f"{summary.get('engine')}; QPS = trajectory starts/s, 0 = single stream)"
    )
    note = saturation_note(summary)
    served = [r for r in summary["rows"] if _served(r)]
    if served:
        what = (
            "QPS x single-stream trajectory latency (the server may sustain more by batching)"
            if any(r.get("utilization_basis") for r in served)
            else "drain ratio = trajectory completion span / arrival span, > 1.25 saturated"
        )
        star = f"* served for real: util = {what}"
        note = star if note is None else star + "\n" + note
    matched = summary.get("matched_rho")
    if matched:
        what = f" (preset {summary['rho_preset']})" if summary.get("rho_preset") else ""
        line = (
            f"matched rho{what}: scheduled {matched['delta']:g} for FullShared/GraphFlow/KVComm/KVCMAS, "
            f"rho {matched['recompute']:g} for the recomputation methods; rho = realized, rho set = target"
        )
        note = line if note is None else line + "\n" + note
    cols = [c for c in SWEEP_COLUMNS if not c.optional or any(r.get(c.key) is not None for r in rows)]
    console.print(fitted_table(console, title, cols, rows, note, "summary.json"))
    if any(r.get("ttft_p50_service_s") is not None for r in rows):
        split_title = "where the TTFT goes (s): own service + queueing, at p50 and p90"
        console.print(fitted_table(console, split_title, TTFT_SPLIT_COLUMNS, rows, TTFT_SPLIT_NOTE, "summary.json"))


def quiet_libraries() -> None:
    """Silence the libraries' own logging, progress bars and warnings (the CLI and every cell worker
    report through this harness only)."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    warnings.filterwarnings("ignore", module="transformers")


class SuiteProgress:
    """Rich progress over a whole suite: one bar for the matrix (samples of every cell, with the
    count of finished cells) and one per cell (samples, running accuracy)."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.cells_done = 0
        self.n_cells = 0

    def begin(self, cells, done: set[str]) -> None:
        self.n_cells, self.cells_done = len(cells), len(done)
        self.bar.start()
        self.matrix = self.bar.add_task(
            "suite", total=sum(c.n for c in cells), completed=sum(c.n for c in cells if c.name in done), info=""
        )
        self._info()
        for c in cells:
            if c.name in done:
                self.bar.add_task(c.name, total=c.n, completed=c.n, info="done earlier")

    def _info(self) -> None:
        self.bar.update(self.matrix, info=f"{self.cells_done}/{self.n_cells} cells")

    def cell(self, cell) -> _CellProgress:
        return _CellProgress(self, self.bar.add_task(cell.name, total=cell.n, info=""))

    def end_cell(self, cell, status: str, detail) -> None:
        self.cells_done += 1
        self._info()
        if status == "failed":
            self.bar.console.print(f"[red]{cell.name} failed:[/] {detail}")

    def stop(self) -> None:
        self.bar.stop()


class _CellProgress:
    """What the ``run`` job reports to (``start``, ``advance``), forwarded to the suite's bars."""

    def __init__(self, suite: SuiteProgress, task):
        self.suite, self.task = suite, task
        self.correct = self.n = 0

    def start(self, total: int, done: int) -> None:
        self.suite.bar.update(self.task, total=total, completed=done)
        self.suite.bar.advance(self.suite.matrix, done)

    def resumed(self, samples: list[dict]) -> None:
        """The samples the cell finished before a resume: counted in the accuracy shown."""
        self.n += len(samples)
        self.correct += sum(bool(s.get("correct")) for s in samples)
        if self.n:
            self.suite.bar.update(self.task, info=f"acc {self.correct / self.n:.3f}")

    def advance(self, rec: dict) -> None:
        self.n += 1
        self.correct += int(rec["correct"])
        self.suite.bar.update(self.task, advance=1, info=f"acc {self.correct / self.n:.3f}")
        self.suite.bar.advance(self.suite.matrix, 1)


COMPARE_COLUMNS = (
    Column("scope", "scope", "text", 0, "left"),
    Column("metric", "metric", "text", 0, "left"),
    Column("baseline", "baseline", "text", 0),
    Column("candidate", "candidate", "text", 0),
    Column("change", "change", "text", 1),
    Column("allowed", "allowed", "text", 2),
)


def print_compare(cmp, console: Console) -> None:
    """The failed checks of a comparison (units in the cells), then its differences and notes."""
    rows = []
    for c in cmp.failures:
        unit = {"s": " s", "MiB": " MiB"}.get(c.kind, "")
        rows.append(
            {
                "scope": c.scope,
                "metric": c.metric,
                "baseline": cell(c.baseline, c.kind) + unit,
                "candidate": cell(c.candidate, c.kind) + unit,
                "change": c.change,
                "allowed": c.allowed,
            }
        )
    if rows:
        console.print(fitted_table(console, "regressions", COMPARE_COLUMNS, rows, more="the --markdown report"))
    label = "deterministic differences" + (" (regressions: --exact)" if cmp.exact else " (not failing without --exact)")
    for title, items in ((label, cmp.differences), ("notes", cmp.notes)):
        if items:
            console.print(f"[bold]{title}:[/]")
            for item in items[:10]:
                console.print(f"  - {item}", markup=False, highlight=False)
            if len(items) > 10:
                console.print(f"  ... and {len(items) - 10} more (see the --markdown report)")


RANK_COLUMNS = (
    Column("workload", "workload", "text", 0, "left"),
    Column("kind", "matrix", "text", 0, "left"),
    Column("part", "K/V", "text", 0),
    Column("tokens", "tokens (mean)", "num", 3),
    Column("dim", "D", "int", 4),
    Column("effective_rank", "eff. rank (mean over layers)", "num", 0),
    Column("effective_rank_max_layer", "max layer", "num", 2),
    Column("err_r8", "rel. error r=8", "err", 1),
    Column("err_r32", "rel. error r=32", "err", 1),
)


def print_rank_summary(df, energy: float, console: Console) -> None:
    """``analyze rank``: effective rank per workload, matrix kind and K/V, with reconstruction errors."""
    from .analysis.rank import KIND_LABELS

    rows = [{**r, "kind": KIND_LABELS.get(r["kind"], r["kind"])} for r in df.to_dict("records")]
    cols = [c for c in RANK_COLUMNS if not rows or c.key in rows[0]]
    title = f"effective rank ({energy:.0%} of the singular-value energy) and reconstruction error"
    console.print(fitted_table(console, title, cols, rows, more="rank_summary.csv"))


CHAIN_COLUMNS = (
    Column("workload", "workload", "text", 3, "left"),
    Column("step", "step", "int", 0),
    Column("node", "agent", "text", 0, "left"),
    Column("method", "method", "text", 0, "left"),
    Column("segments", "shared segments", "int", 4),
    Column("corrected", "corrected", "int", 2),
    Column("kv_rel_error", "KV error (all)", "err", 0),
    Column("kv_rel_error_corrected", "KV error (corrected)", "err", 0),
)


def print_chain(df, console: Console) -> None:
    """``analyze chain``: KV error per agent in execution order, chained next to non-chained."""
    if df.empty:
        console.print("no shared segments with a measured error")
        return
    rows = df.sort_values(["workload", "step", "method"]).to_dict("records")
    title = "relative KV error per agent (all shared segments; corrected ones only)"
    console.print(fitted_table(console, title, list(CHAIN_COLUMNS), rows, more="chain_per_agent.csv"))


def print_ablation(df, kind: str, console: Console) -> None:
    """``ablate``: one table per workload, one row per point."""
    from .analysis.ablation import table_columns

    if df.empty:
        console.print("no finished points")
        return
    for w, g in df.groupby("workload", sort=False):
        title = f"ablate {kind}: {w} (n = {int(g['n'].max())})"
        console.print(
            fitted_table(console, title, table_columns(kind, g), g.to_dict("records"), more=f"ablate-{kind}.md")
        )
