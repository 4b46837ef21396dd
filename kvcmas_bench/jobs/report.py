"""The ``report`` job: run, suite and sweep directories -> tables, figures, Markdown/HTML, exports.

Output directory: ``report.md`` and ``report.html`` (one self-contained page), ``figures/`` (PNG and
SVG of every figure), and with ``csv``/``parquet`` the tidy frames: ``table1``, ``runs``,
``samples``, ``requests``, ``agreement`` (per sample, against NonShared), ``repeats`` (accuracy
across seeds, when a configuration ran at several) and ``sweeps``.

Table 1 is one table per comparison group (runs of one workload with the same settings), over the
samples every run of the group finished; see :mod:`kvcmas_bench.report.tables` for the
uncertainty of its proportions and the rule of the best / second-best marks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console

from ..console import SWEEP_COLUMNS, fitted_table, print_sweep_table, saturation_note
from ..errors import BenchError
from ..report.columns import Column, cell
from ..report.render import MARK_NOTE, Document, Section, markdown, to_html
from ..report.tables import (
    MARK_ALPHA,
    agreement_frame,
    repeats_frame,
    section_rows,
    table1,
    visible_columns,
)
from ..results.frames import Results, load_dirs
from ..results.outdir import check_output_dir, lock_output_dir
from ..serving.metrics import DEFINITIONS as SWEEP_DEFINITIONS

FORMATS = ("md", "html", "csv", "parquet")
DEFINITIONS = [
    "Table 1 compares the runs of one workload with the same settings (model, seed, token budgets, ...) over "
    "the samples every one of them finished: n is that common count, and every figure of the table (accuracy, "
    "agreement, latency, memory, rho, fidelity) is over those samples and their requests.",
    "accuracy: share of samples whose final answer the workload scores correct.",
    "± SE [95% CI] (accuracy, both agreements, top-1 agree): the binomial standard error sqrt(p(1-p)/n) "
    "(divisor n; n samples, or requests for the first-token and top-1 figures, counted as independent) and "
    "the 95% Wilson score interval.",
    "acc. - NonShared: accuracy minus NonShared's on the same samples; McNemar p: the exact two-sided McNemar "
    "test of that difference (a binomial test with p = 1/2 on the samples exactly one of the two gets right).",
    f"best / second-best marks: among the sharing methods of a table, the highest accuracy is marked best only "
    f"when the exact McNemar test on the common samples finds it higher than every other sharing method's "
    f"(p < {MARK_ALPHA:g} against each); the runner-up is marked second by the same rule against every method "
    "below it. Otherwise the methods not significantly different from the top (or the runner-up) tie and are "
    "named in a note under the table.",
    "accuracy across repeats: mean and sample standard deviation (divisor n - 1) of a configuration's Table 1 "
    "accuracy at each seed (suite --repeats).",
    "agree w/ NonShared: share of common samples whose final answer equals NonShared's on the same sample "
    "(HumanEval: the final output); first-token agree: share of common requests (sample, step) whose first "
    "generated token equals NonShared's. An unparsed answer agrees with nothing (not even another unparsed "
    "one), so NonShared's row, its own reference, reads the share of its samples with a parsed answer.",
    "E2E latency: sum of the agents' end-to-end times per sample (s), mean over samples.",
    "TTFT: time to first token per agent request (s), including correction and reference-prefill work.",
    "peak mem: max over requests of the device peak (CUDA) or the process peak RSS (CPU), MiB.",
    "method state: max over requests of the method's own state (anchor pools, references, calibration tables), MiB.",
    "rho: (token, layer) entries served by reuse / reuse-eligible shared entries.",
    "KV rel. error, top-1 agree, first-token KL (with --fidelity): against a full dense prefill of the same "
    "prompt; the KV error is the mean over every shared segment of every request, the definition of "
    "summary.json's fidelity.kv_rel_error. Table 1, summary.json and the exported frames take every figure from "
    "one function (results.summary.run_figures), under the same names (ttft_p90_s, method_state_peak_bytes, "
    "...), each defined once in results/figures.py.",
]


@dataclass
class ReportResult:
    out_dir: Path
    results: Results
    table1: pd.DataFrame
    repeats: pd.DataFrame = field(default_factory=pd.DataFrame)
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
    """Load ``dirs``, compute the tables, draw the figures and write the requested formats.

    The output directory is checked and locked before anything is read (as ``run`` does): a path
    that is a file, lies under a file or cannot be written is one ``BenchError`` line, and a report
    that fails leaves no new directory behind."""
    formats = parse_formats(formats)
    if "parquet" in formats:
        _require_parquet()
    out = Path(out_dir)
    with lock_output_dir(out):
        _check_targets(out, formats, plots)
        results = load_dirs(list(dirs))
        if not results.runs and not results.sweeps:
            raise BenchError(f"no finished samples in {', '.join(map(str, dirs))}")
        t1 = table1(results)
        res = ReportResult(out, results, t1, repeats_frame(results, t1))
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


#: the frames ``--format csv|parquet`` may write (:func:`frames`)
FRAME_NAMES = ("table1", "runs", "samples", "requests", "agreement", "repeats", "sweeps")


def _check_targets(out: Path, formats: Sequence[str], plots: bool) -> None:
    """Every path the report will write inside ``out`` can be written (none is a directory, the
    figures folder is not a file), checked before any work."""
    if plots:
        check_output_dir(out / "figures", "figures folder")
    names = [f"report.{f}" for f in ("md", "html") if f in formats]
    names += [f"{n}.{f}" for f in ("csv", "parquet") if f in formats for n in FRAME_NAMES]
    for name in names:
        if (out / name).is_dir():
            raise BenchError(f"cannot write the report: {out / name} is a directory")


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
        for table, g in res.table1.groupby("table", sort=False):
            figs += workload_figures(g, str(table), fig_dir, _stem(str(table)))
    for s in res.results.sweeps:
        note = sweep_note({**s.summary, "model": s.config.get("model"), "device": s.config.get("device")})
        name = s.run_id.split(":", 1)[1]
        figs += sweep_figures(s.summary["rows"], name, note, fig_dir, bool(s.config.get("accumulated")))
    return figs


def _stem(table: str) -> str:
    """A file stem for a table's figures: ``mmlu`` -> ``mmlu``, ``mmlu, seed=1`` -> ``mmlu-seed-1``."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", table).strip("-")


UNCERTAINTY_NOTE = (
    "accuracy and agreements: value ± binomial SE [95% Wilson interval]; acc. - NonShared: on the same "
    "samples, with the exact McNemar p."
)


def samples_note(g: pd.DataFrame) -> str | None:
    """What the table's figures are over, when its runs did not all finish the same samples."""
    scope = g["sample_scope"].iloc[0]
    if scope == "common":
        more = ", ".join(f"{r.label} {r.n_finished}" for r in g.itertuples() if r.n_finished != r.n)
        return (
            f"Compared over the {int(g['n'].max())} samples every run of this table finished; the runs with "
            f"more finished samples ({more}) are cut to those."
        )
    if scope == "own" and len(g) > 1:
        each = ", ".join(f"{r.label} {r.n}" for r in g.itertuples())
        return f"These runs share no finished sample: each row is over its own samples ({each}); nothing is marked."
    return None


def noise_notes(g: pd.DataFrame) -> list[str]:
    """The group's noise floor (two NonShared runs' agreement) and which methods agree with
    NonShared within it."""
    if "noise_answer_agreement" not in g or g["noise_answer_agreement"].isna().all():
        return []
    r = g[g["noise_answer_agreement"].notna()].iloc[0]
    f3 = lambda v: "-" if v is None or pd.isna(v) else f"{v:.3f}"  # noqa: E731
    out = [
        f"Noise floor: NonShared against itself ({r['noise_pair']}) agrees on "
        f"{f3(r['noise_answer_agreement'])} ± {f3(r.get('noise_answer_agreement_se'))} of answers and "
        f"{f3(r.get('noise_first_token_agreement'))} of first tokens: the engine's own disagreement "
        "(greedy decoding is not batch-invariant), beside which every agreement with NonShared is read."
    ]
    for verdict in ("within noise", "below noise") if "agreement_vs_noise" in g else ():
        names = g[g["agreement_vs_noise"] == verdict]["label"].tolist()
        if names:
            rule = f"exact McNemar against the floor, p < {MARK_ALPHA:g}"
            out.append(f"Agreement with NonShared {verdict} ({rule}): {', '.join(names)}.")
    return out


def mark_notes(g: pd.DataFrame) -> list[str]:
    """The ties of the best / second-best rule, named."""
    n = int(g["n"].max()) if g["n"].notna().any() else 0
    rule = f"exact McNemar, p < {MARK_ALPHA:g} on the {n} common samples"
    out = []
    tied = g[g["acc_mark"] == "tied"]["label"].tolist()
    if tied:
        out.append(
            f"No sharing method's accuracy is significantly higher than every other's ({rule}): "
            f"{', '.join(tied)} tie for the best accuracy; none is marked."
        )
    tied2 = g[g["acc_mark"] == "tied-second"]["label"].tolist()
    if tied2:
        out.append(f"Below the best, {', '.join(tied2)} tie for the second place ({rule}); none is marked second.")
    return out


def _tables(t1: pd.DataFrame) -> list[pd.DataFrame]:
    """Table 1's rows per comparison group; in a table of one seed (``mmlu, seed=1``) the labels
    without their ``seed=`` part (the title says it)."""
    out = []
    for table, g in t1.groupby("table", sort=False):
        if ", seed=" in str(table):
            g = g.assign(label=g["label"].map(lambda s: re.sub(r" seed=\S+", "", str(s))))
        out.append(g)
    return out


def table1_sections(t1: pd.DataFrame) -> list[Section]:
    """One Table 1 section per comparison group (a workload, or a workload at one seed / setting)."""
    sections = []
    for g in _tables(t1):
        table = g["table"].iloc[0]
        cols = visible_columns(g)
        notes = [n for n in [samples_note(g)] if n]
        if "answer_agreement" in g and g["answer_agreement"].notna().any():
            refs = sorted(set(g["reference"].dropna()))
            n = int(g["agreement_samples"].dropna().min())
            notes.append(f"Agreement reference: {', '.join(refs)} (at least {n} common samples per run).")
        else:
            notes.append("No NonShared run over the same samples among the inputs: agreement not reported.")
        notes += noise_notes(g) + mark_notes(g) + [UNCERTAINTY_NOTE]
        models = ", ".join(sorted({str(m) for m in g["model"]}))
        devices = ", ".join(sorted({str(d) for d in g["device"]}))
        title = f"Table 1: {table} ({models} on {devices}; n = {', '.join(sorted({str(x) for x in g['n']}))})"
        sections.append(Section(title, cols, section_rows(g), g["acc_mark"].tolist(), notes))
    return sections


REPEAT_COLUMNS = (
    Column("label", "method", "text", 0, "left"),
    Column("repeats", "repeats", "int", 0),
    Column("seeds", "seeds", "text", 3),
    Column("n_text", "n per repeat", "text", 2),
    Column("accuracy_mean", "accuracy mean", "acc", 0),
    Column("accuracy_std", "accuracy std", "acc", 0),
)


def repeats_sections(rep: pd.DataFrame) -> list[Section]:
    """Accuracy across repeats (mean and standard deviation over seeds), one section per workload."""
    sections = []
    if rep.empty:
        return sections
    for workload, g in rep.groupby("workload", sort=False):
        rows = [
            {**r, "n_text": str(r["n_min"]) if r["n_min"] == r["n_max"] else f"{r['n_min']}-{r['n_max']}"}
            for r in g.to_dict("records")
        ]
        note = "Per repeat, the accuracy of its own Table 1 (over that seed's common samples)."
        sections.append(Section(f"Accuracy across repeats: {workload}", list(REPEAT_COLUMNS), rows, notes=[note]))
    return sections


def accounting_section(results: Results) -> Section | None:
    """Method counters and segment statuses of every run, summed from its request records (what
    ``summary.json``'s ``accounting`` holds, recomputed)."""
    from ..results.summary import accounting

    rows = []
    for r in results.runs:
        acc = accounting(r.records) if r.records else None
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
    return Section("Method accounting (from the request records)", cols, rows)


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
    intro = [f"{kind}: {path}" for path, kind in results.inputs.items()] + list(results.notes)
    sections = table1_sections(res.table1) if not res.table1.empty else []
    sections += repeats_sections(res.repeats)
    acc = accounting_section(results)
    sections += ([acc] if acc else []) + sweep_sections(results)
    from ..results.summary import DEFINITIONS as RUN_DEFINITIONS
    from ..results.summary import accounting, starved_warning

    for r in results.runs:
        w = starved_warning(accounting(r.records)) if r.records else None
        if w:
            intro.append(f"warning: {r.run_id}: {w}")
        if r.config.get("warmup_samples"):
            intro.append(f"{r.run_id}: {len(r.config['warmup_samples'])} warm-up samples ran first, in no figure")

    intro += [
        f"{r.path}/summary.json disagrees with its records, which are used: {d}"
        for r in results.runs
        for d in r.disagreements[:3]
    ]
    intro += [
        f"{s.path}/summary.json disagrees with its records, which are used: {d}"
        for s in results.sweeps
        for d in s.disagreements[:3]
    ]
    definitions = list(DEFINITIONS)
    if results.runs:
        definitions += [f"{k}: {v}" for k, v in RUN_DEFINITIONS.items()]
    if results.sweeps:
        definitions += [f"serve-sweep {k}: {v}" for k, v in SWEEP_DEFINITIONS.items()]
    intro += [f"figure {f.name}: {p}" for f in res.figures for p in getattr(f, "problems", [])[:3]]
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
        "repeats": res.repeats,
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


def _short_estimate(v) -> str:
    """``0.833±.152`` (the console's compact form of a proportion with its SE: one unbroken
    token, so an 80-column table never wraps it)."""
    if not isinstance(v, (tuple, list)):
        return cell(v, "est")
    if v[1] is None or pd.isna(v[1]):
        return cell(v[0], "est")
    se = f"{float(v[1]):.3f}"
    return cell(v[0], "est") + "±" + (se[1:] if se.startswith("0.") else se)


def console_table1(res: ReportResult, console: Console) -> None:
    """Table 1 per comparison group, fitted to the console (accuracy marks as superscripts, ties
    named in the caption), then the accuracy across repeats and the sweeps."""
    more = str(res.out_dir / "report.md") if any(f.name == "report.md" for f in res.files) else "the report"
    groups = _tables(res.table1) if not res.table1.empty else []
    for g, s in zip(groups, table1_sections(res.table1) if groups else []):
        rows = []
        for row, mark in zip(s.rows, s.marks or []):
            row = {**row, **{c.key: _short_estimate(row.get(c.key)) for c in s.columns if c.kind == "est"}}
            acc = row.get("accuracy", "-")
            rows.append({**row, "accuracy": {"best": f"[bold]{acc}¹[/]", "second": f"{acc}²"}.get(mark, acc)})
        # the console shows value ± SE; the intervals are in the report
        cols = [
            Column(c.key, c.header.replace(" [95% CI]", ""), "text", c.priority, c.justify) if c.kind == "est" else c
            for c in s.columns
        ]
        marked = any(m in ("best", "second") for m in s.marks or [])
        caption = "\n".join(([MARK_NOTE["console"]] if marked else []) + noise_notes(g) + mark_notes(g)) or None
        console.print(fitted_table(console, s.title, cols, rows, caption, more))
    for s in repeats_sections(res.repeats):
        console.print(fitted_table(console, s.title, s.columns, s.rows, None, more))
    for sw in res.results.sweeps:
        print_sweep_table({**sw.summary, "device": sw.config.get("device")}, console)
