"""Figures a reader can trust at a glance (issue 49): every report figure type drawn from small
hand-made frames (crowded points, tied points, wide intervals, a point far outside the frame) is
checked from matplotlib's own geometry: no two labels overlap, no text leaves the figure, every
point and interval end lies inside the axes. The check itself is shown to fail where it must."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from kvcmas_bench.report.figcheck import figure_problems
from kvcmas_bench.report.plots import meta_line, pareto_axes, rho_axes

#: (method, TTFT s, accuracy): six sharing methods crowded near TTFT 1.2, ties at 0.5 and 0.333,
#: one method at accuracy 0 (the bottom edge)
CROWD = [
    ("nonshared", 2.0, 0.5),
    ("fullshared", 1.0, 1 / 3),
    ("kvcmas", 1.2, 0.5),
    ("kvcomm", 1.21, 0.5),
    ("graphflow", 1.19, 0.5),
    ("cacheblend", 1.22, 1 / 3),
    ("droidspeak", 1.2, 1 / 3),
    ("relaycaching", 1.21, 1 / 3),
    ("kvcmas-nonchained", 1.2, 0.0),
]


def frame(points=CROWD, half_width: float = 0.35, label=None) -> pd.DataFrame:
    """Table 1 rows with 95% intervals ``half_width`` wide on each side (clipped to [0, 1])."""
    rows = []
    for m, x, y in points:
        rows.append(
            {
                "method": m,
                "label": label(m) if label else m,
                "ttft_mean_s": x,
                "latency_mean_s": 10 * x,
                "accuracy": y,
                "accuracy_ci_low": max(0.0, y - half_width),
                "accuracy_ci_high": min(1.0, y + half_width),
                "answer_agreement": min(1.0, y + 0.5),
                "answer_agreement_ci_low": max(0.0, min(1.0, y + 0.5) - half_width),
                "answer_agreement_ci_high": 1.0,
                "reuse_ratio": 0.0 if m == "nonshared" else 0.8,
                "model": "SmolLM2-135M-Instruct",
                "device": "cpu",
                "prompt_tokens_mean": 241.0,
                "prompt_tokens_max": 512,
            }
        )
    return pd.DataFrame(rows)


def title(df: pd.DataFrame, caption: str) -> str:
    return f"mmlu: {caption}\n{meta_line(df)}; bars: 95% Wilson interval"


CASES = {
    "crowded-wide": frame(),
    "narrow": frame(half_width=0.05),
    "all-tied": frame([(m, 1.2, 0.5) for m, _, _ in CROWD]),
    "far-point": frame([*CROWD[:-1], ("kvcmas-nonchained", 60.0, 0.95)]),
    "at-extremes": frame([("nonshared", 2.0, 1.0), ("fullshared", 1.0, 0.0), ("kvcmas", 1.5, 1.0)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("x", ["ttft_mean_s", "latency_mean_s"])
@pytest.mark.parametrize("y", ["accuracy", "answer_agreement"])
def test_pareto_figures_are_legible(case, x, y):
    df = CASES[case]
    fig, ax = pareto_axes(df, x, y, title(df, f"{y} vs {x}"))
    try:
        assert figure_problems(fig) == []
        lo, hi = ax.get_ylim()  # every interval inside the axes, not cut at the edge
        assert lo <= df[f"{y}_ci_low"].min() and hi >= df[f"{y}_ci_high"].max()
    finally:
        plt.close(fig)


def test_accuracy_vs_rho_with_crowded_settings_is_legible():
    pts = [("nonshared", 2.0, 0.5)] + [("cacheblend", 1.2, 0.5)] * 4 + [("droidspeak", 1.2, 0.5)] * 3
    df = frame(pts)
    df.loc[df["method"] != "nonshared", "reuse_ratio"] = [0.5, 0.6, 0.7, 0.8, 0.5, 0.6, 0.7]
    df["label"] = [m if m == "nonshared" else f"{m} rho={r}" for m, r in zip(df["method"], df["reuse_ratio"])]
    fig, _ = rho_axes(df, "accuracy", title(df, "accuracy vs reuse ratio"))
    try:
        assert figure_problems(fig) == []
    finally:
        plt.close(fig)


def test_chain_and_ablation_figures_are_legible():
    from kvcmas_bench.analysis.ablation import pareto_figure, sweep_figure
    from kvcmas_bench.analysis.chain import chain_figure

    agents = pd.DataFrame(
        [{"method": m, "step": s, "kv_rel_error": 0.01 * (s + 1) * (2 if "non" in m else 1),
          "kv_rel_error_corrected": 0.02 * s or None}
         for m in ("kvcmas", "kvcmas-nonchained") for s in range(4)]
    )  # fmt: skip
    layers = pd.DataFrame(
        [{"method": m, "layer": i, "kv_rel_error": 0.001 * i, "kv_rel_error_corrected": 0.002 * i}
         for m in ("kvcmas", "kvcmas-nonchained") for i in range(30)]
    )  # fmt: skip
    long = "mmlu " + "(SmolLM2-135M-Instruct on cpu; a long subtitle that must wrap) " * 3
    figs = [chain_figure(agents, layers, long)[0]]
    abl = pd.DataFrame(
        [{"method": "kvcmas", "point": f"v{v}", "V": v, "anchors": v, "reuse_ratio": 0.1 * v, "kv_rel_error": 0.01 / v,
          "answer_agreement": 0.5 + 0.05 * v, "first_token_agreement": 0.9, "method_state_peak_bytes": 2**20 * v,
          "ttft_mean_s": 1.0, "gate": "scaled", "tau": 0.5}
         for v in (1, 2, 5, 10)]
        + [{"method": "nonshared", "point": "ref", "answer_agreement": 1.0, "kv_rel_error": 0.0, "reuse_ratio": 0.0}]
    )  # fmt: skip
    figs.append(sweep_figure(abl, "anchors", long)[0])
    figs.append(pareto_figure(abl, long)[0])
    try:
        for fig in figs:
            assert figure_problems(fig) == []
    finally:
        for fig in figs:
            plt.close(fig)


# ---- the check fails where it must ------------------------------------------------------------------
def test_the_check_sees_overlapping_labels_clipped_intervals_and_text_off_the_figure():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.scatter([1.0], [0.5], gid="point:a")
    ax.annotate("RelayCaching", (1.0, 0.5), textcoords="offset points", xytext=(4, 4))
    ax.annotate("DroidSpeak", (1.0, 0.5), textcoords="offset points", xytext=(6, 5))
    ax.plot([1.0, 1.0], [0.1, 0.9], gid="ci:kvcomm")
    ax.scatter([3.0], [0.5], gid="point:far")
    ax.set_xlim(0, 2)
    ax.set_ylim(0.3, 0.7)
    ax.set_title("a title far too long for a figure four inches wide, so it runs off both of its edges")
    try:
        problems = figure_problems(fig)
    finally:
        plt.close(fig)
    assert "'RelayCaching' overlaps 'DroidSpeak'" in problems
    assert "an end of ci:kvcomm lies outside the axes" in problems
    assert "a point of point:far lies outside the axes" in problems
    assert any(p.startswith("text 'a title far too long") and p.endswith("leaves the figure") for p in problems)


def test_every_figure_of_a_report_passes_the_check(tmp_path):
    from kvcmas_bench.jobs.report import build_report

    from .synthetic import make_matrix

    m = make_matrix(tmp_path / "m")
    res = build_report(list(m.values()), tmp_path / "rep", ["md"], plots=True)
    assert len(res.figures) >= 6
    assert {f.name: f.problems for f in res.figures if f.problems} == {}


def sweep_rows() -> list[dict]:
    """Serve-sweep rows: nine methods at two lengths and three rates, one saturated at 8 QPS with a
    TTFT 100 times the rest (an extreme point), two methods tied everywhere; TTFT parts filled."""
    rows = []
    for i, m in enumerate(("nonshared", "fullshared", "cacheblend", "droidspeak", "relaycaching", "graphflow",
                           "kvcomm", "kvcmas", "kvcmas-nonchained")):  # fmt: skip
        for s in (2048, 8192):
            for q in (0.0, 2.0, 8.0):
                base = 0.2 + 0.01 * (i if m != "kvcmas-nonchained" else 7) + s / 1e5
                sat = m == "nonshared" and q == 8.0
                t50 = base * (100 if sat else 1 + q / 10)
                row = {"method": m, "shared_tokens": s, "qps": q, "saturated": sat,
                       "ttft_p50_s": t50, "ttft_p90_s": 1.5 * t50}  # fmt: skip
                for st, t in (("p50", t50), ("p90", 1.5 * t50)):
                    row.update({f"ttft_{st}_service_s": 0.6 * t, f"ttft_{st}_queue_s": 0.4 * t,
                                f"ttft_{st}_service_shared_dense_s": 0.2 * t,
                                f"ttft_{st}_service_shared_reuse_s": 0.2 * t,
                                f"ttft_{st}_service_other_s": 0.2 * t, f"ttft_{st}_queue_dense_s": 0.2 * t,
                                f"ttft_{st}_queue_other_s": 0.2 * t})  # fmt: skip
                rows.append(row)
    return rows


@pytest.mark.parametrize("lengths", [(2048, 8192), (1024,)])
@pytest.mark.parametrize("which", ["ttft_p50", "ttft_p90", "ttft_parts", "chained_ttft_p50"])
def test_serve_sweep_figures_are_legible(which, lengths, tmp_path, monkeypatch):
    from kvcmas_bench.serving import plots as splots

    kept = []
    monkeypatch.setattr(splots.plt, "close", kept.append)  # keep each figure to read its geometry
    note = "SmolLM2-135M-Instruct on cpu, engine in-process; NonShared capacity 1.9 QPS at 2048 tokens"
    rows = [r for r in sweep_rows() if r["shared_tokens"] in lengths or len(lengths) == 1]
    if len(lengths) == 1:  # one panel (the narrowest figure) and reproduce's four methods: the legend must fit
        four = ("nonshared", "graphflow", "kvcmas", "kvcmas-nonchained")
        rows = [{**r, "shared_tokens": lengths[0]} for r in rows if r["shared_tokens"] == 2048 and r["method"] in four]
    paths = splots.plot_all(rows, tmp_path, note=note)
    monkeypatch.undo()
    by_name = {Path(p).stem: f for p, f in zip(paths, kept)}
    fig = by_name[which]
    try:
        assert figure_problems(fig) == []
    finally:
        plt.close(fig)


def test_the_paper_figure_set_doc_shows_committed_small_images():
    import re

    root = Path(__file__).resolve().parents[1] / "docs"
    links = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", (root / "figures.md").read_text())
    assert len(links) >= 10
    for link in links:
        p = root / link
        assert p.is_file(), link
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000, link
