"""The ``report`` job: run, suite and sweep directories -> tables, figures, Markdown/HTML, exports.

Output directory: ``report.md`` and ``report.html`` (one self-contained page), ``figures/`` (PNG and
SVG of every figure), and with ``csv``/``parquet`` the tidy frames: ``table1``, ``runs``,
``samples``, ``requests``, ``agreement`` (per sample, against NonShared) and ``sweeps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console

from ..console import SWEEP_COLUMNS, fitted_table, print_sweep_table, saturation_note
from ..errors import BenchError
from ..report.columns import Column
from ..report.render import MARK_NOTE, Document, Section, markdown, to_html
from ..report.tables import agreement_frame, table1, visible_columns
from ..results.frames import Results, load_dirs
from ..serving.metrics import DEFINITIONS as SWEEP_DEFINITIONS

FORMATS = ("md", "html", "csv", "parquet")
DEFINITIONS = [
    "accuracy: share of samples whose final answer the workload scores correct.",
    "agree w/ NonShared: share of common samples whose final answer equals NonShared's on the same sample "
    "(HumanEval: the final output); first-token agree: share of common requests (sample, step) whose first "
    "generated token equals NonShared's. NonShared's reference is itself.",
    "E2E latency: sum of the agents' end-to-end times per sample (s), mean over samples.",
    "TTFT: time to first token per agent request (s), including correction and reference-prefill work.",
    "peak mem: max over requests of the device peak (CUDA) or the process peak RSS (CPU), MiB.",
    "method state: max over requests of the method's own state (anchor pools, references, calibration tables), MiB.",
    "rho: (token, layer) entries served by reuse / reuse-eligible shared entries.",
    "KV rel. error, top-1 agree, first-token KL (with --fidelity): against dense prefill; the KV error is the "
    "mean over every shared segment reused from a source.",
]


@dataclass
class ReportResult:
    out_dir: Path
    results: Results
    table1: pd.DataFrame
    figures: list = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


def parse_formats(text: str | Sequence[str]) -> list[str]:
    items = [s.strip().lower() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    bad = [s for s in items if s not in FORMATS]
    if bad or not items:
        raise BenchError(f"--format takes a comma-separated list of {', '.join(FORMATS)}; got {text!r}")
    return list(dict.fromkeys(items))


def build_report(
    dirs: Sequence[str | Path], out_dir: str | Path, formats: Sequence[str] = ("md", "html"), plots: bool = True
) -> ReportResult:
    """Load ``dirs``, compute the tables, draw the figures and write the requested formats."""
    formats = parse_formats(formats)
    if "parquet" in formats:
        _require_parquet()
    results = load_dirs(list(dirs))
    if not results.runs and not results.sweeps:
        raise BenchError(f"no finished samples in {', '.join(map(str, dirs))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = ReportResult(out, results, table1(results))
    if plots:
        res.figures = draw_figures(res, out / "figures")
    doc = document(res)
    if "md" in formats:
        res.files.append(_write(out / "report.md", markdown(doc, out)))
    if "html" in formats:
        res.files.append(_write(out / "report.html", to_html(doc)))
    for fmt in ("csv", "parquet"):
        if fmt in formats:
            res.files += export(res, out, fmt)
    return res


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _require_parquet() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise BenchError("--format parquet needs pyarrow: pip install pyarrow") from None


def draw_figures(res: ReportResult, fig_dir: Path) -> list:
    from ..report.plots import sweep_figures, workload_figures
    from ..serving.plots import sweep_note

    figs = []
    if not res.table1.empty:
        for workload, g in res.table1.groupby("workload", sort=False):
            figs += workload_figures(g, str(workload), fig_dir)
    for s in res.results.sweeps:
        note = sweep_note({**s.summary, "model": s.config.get("model"), "device": s.config.get("device")})
        name = s.run_id.split(":", 1)[1]
        figs += sweep_figures(s.summary["rows"], name, note, fig_dir, bool(s.config.get("accumulated")))
    return figs


def table1_sections(t1: pd.DataFrame) -> list[Section]:
    """One Table 1 section per workload."""
    sections = []
    for workload, g in t1.groupby("workload", sort=False):
        cols = visible_columns(g)
        notes = []
        if "answer_agreement" in g and g["answer_agreement"].notna().any():
            refs = sorted(set(g["reference"].dropna()))
            n = int(g["agreement_samples"].dropna().min())
            notes.append(f"Agreement reference: {', '.join(refs)} (at least {n} common samples per run).")
        else:
            notes.append("No NonShared run over the same samples among the inputs: agreement not reported.")
        models = ", ".join(sorted({str(m) for m in g["model"]}))
        devices = ", ".join(sorted({str(d) for d in g["device"]}))
        title = f"Table 1: {workload} ({models} on {devices}; n = {', '.join(sorted({str(x) for x in g['n']}))})"
        sections.append(Section(title, cols, g.to_dict("records"), g["acc_mark"].tolist(), notes))
    return sections


def accounting_section(results: Results) -> Section | None:
    """Counts of ``summary.json``'s ``accounting`` (when the runs recorded it)."""
    rows = []
    for r in results.runs:
        acc = r.summary.get("accounting")
        if isinstance(acc, dict):
            segments = acc.get("segments") or {}
            # a method's own counter named like a segment status (GraphFlow's corrected/uncalibrated)
            # repeats that status count: shown once, as the status count
            flat = {
                k: v for k, v in acc.items() if isinstance(v, (int, float)) and not (k in segments and segments[k] == v)
            }
            flat.update({f"segments {k}": v for k, v in segments.items()})
            rows.append({"run": r.run_id, **flat})
    if not rows:
        return None
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "run"))
    cols = [Column("run", "run", "text", 0, "left")] + [Column(k, k.replace("_", " "), "num") for k in keys]
    return Section("Method accounting (summary.json)", cols, rows)


def sweep_sections(results: Results) -> list[Section]:
    out = []
    for s in results.sweeps:
        rows = [
            {
                **r,
                "util_cell": (f"{r['utilization']:.3g}" if r.get("utilization") is not None else "-")
                + (" (saturated)" if r.get("saturated") else ""),
            }
            for r in s.summary["rows"]
        ]
        note = saturation_note(s.summary)
        title = f"serve-sweep {s.path} ({s.config.get('model')} on {s.config.get('device')}; TTFT in s)"
        out.append(Section(title, list(SWEEP_COLUMNS), rows, notes=[note] if note else []))
    return out


def document(res: ReportResult) -> Document:
    results = res.results
    intro = [f"{kind}: {path}" for path, kind in results.inputs.items()]
    sections = table1_sections(res.table1) if not res.table1.empty else []
    acc = accounting_section(results)
    sections += ([acc] if acc else []) + sweep_sections(results)
    definitions = list(DEFINITIONS)
    for r in results.runs[:1]:
        definitions += [f"{k}: {v}" for k, v in (r.summary.get("definitions") or {}).items()]
    if results.sweeps:
        definitions += [f"serve-sweep {k}: {v}" for k, v in SWEEP_DEFINITIONS.items()]
    return Document("kvcmas-bench report", intro, sections, res.figures, definitions)


def frames(res: ReportResult) -> dict[str, pd.DataFrame]:
    """The tidy frames exported by ``--format csv|parquet`` (empty ones left out)."""
    r = res.results
    out = {
        "table1": res.table1,
        "runs": r.runs_frame(),
        "samples": r.samples_frame(),
        "requests": r.requests_frame(),
        "agreement": agreement_frame(r),
        "sweeps": r.sweep_frame(),
    }
    return {k: v for k, v in out.items() if not v.empty}


def export(res: ReportResult, out: Path, fmt: str) -> list[Path]:
    paths = []
    for name, df in frames(res).items():
        path = out / f"{name}.{fmt}"
        if fmt == "csv":
            df.to_csv(path, index=False)
        else:
            _parquet_safe(df).to_parquet(path, index=False)
        paths.append(path)
    return paths


def _parquet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns mixing types (str and numbers, lists) as strings, which parquet requires."""
    df = df.copy()
    for col in [c for c in df.columns if pd.api.types.is_object_dtype(df[c])]:
        kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and pd.isna(v))}
        if len(kinds) > 1 or kinds & {list, dict}:
            df[col] = df[col].map(lambda v: None if v is None else str(v))
    return df


def console_table1(res: ReportResult, console: Console) -> None:
    """Table 1 per workload, fitted to the console; accuracy marks as superscripts."""
    for s in table1_sections(res.table1) if not res.table1.empty else []:
        rows = []
        for row, mark in zip(s.rows, s.marks or []):
            acc = "-" if pd.isna(row.get("accuracy")) else f"{row['accuracy']:.3f}"
            acc = {"best": f"[bold]{acc}¹[/]", "second": f"{acc}²"}.get(mark, acc)
            rows.append({**row, "accuracy": acc})
        cols = [Column(c.key, c.header, "text", c.priority, c.justify) if c.key == "accuracy" else c for c in s.columns]
        caption = MARK_NOTE["console"] if any(s.marks or []) else None
        more = str(res.out_dir / "report.md") if any(f.name == "report.md" for f in res.files) else "the report"
        console.print(fitted_table(console, s.title, cols, rows, caption, more))
    for sw in res.results.sweeps:
        print_sweep_table({**sw.summary, "device": sw.config.get("device")}, console)
