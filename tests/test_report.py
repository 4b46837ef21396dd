"""report: loaders, Table 1, agreement with NonShared, Pareto/rho/sweep figures (their artists),
Markdown/HTML/CSV/Parquet outputs, and console tables readable at 80 columns."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest
from rich.console import Console

from kvcmas_bench.errors import BenchError
from kvcmas_bench.jobs.report import build_report, console_table1
from kvcmas_bench.report.plots import frontier, pareto_axes, rho_axes
from kvcmas_bench.report.tables import reference_for, request_agreement, sample_agreement, table1
from kvcmas_bench.results.frames import dir_kind, load_dirs

from .conftest import run_cli
from .synthetic import make_matrix, make_run, make_sweep


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    runs = make_matrix(root)
    runs["sweep"] = make_sweep(root / "sweep")
    return runs


@pytest.fixture(scope="module")
def t1(matrix):
    return table1(load_dirs([p for k, p in matrix.items() if k != "sweep"])).set_index("label")


def narrow() -> Console:
    return Console(width=80, file=io.StringIO(), record=True)


# ---- loaders and tables --------------------------------------------------------------------------
def test_dir_kinds_and_tidy_frames(matrix):
    assert dir_kind(matrix["kvcmas"]) == "run" and dir_kind(matrix["sweep"]) == "sweep"
    res = load_dirs(list(matrix.values()))
    assert len(res.runs) == 5 and len(res.sweeps) == 1
    # several runs of one method are told apart by the option that differs
    assert {r.label for r in res.runs} >= {"cacheblend rho=0.5", "cacheblend rho=0.9", "kvcmas"}
    s, r = res.samples_frame(), res.requests_frame()
    assert len(s) == 30 and len(r) == 60
    assert {"run_id", "workload", "method", "label", "prediction", "correct"} <= set(s.columns)
    assert {"first_token_id", "ttft_s", "seg_reused", "seg_recomputed", "sample_id", "step"} <= set(r.columns)
    assert len(res.sweep_frame()) == 6


def test_table1_figures_and_marks(t1):
    assert t1.loc["nonshared", "accuracy"] == pytest.approx(4 / 6)
    assert t1.loc["kvcmas", "accuracy"] == pytest.approx(5 / 6)
    assert t1.loc["kvcmas", "reuse_ratio"] == pytest.approx(0.8)
    assert t1.loc["fullshared", "reuse_ratio"] == pytest.approx(1.0)
    assert t1.loc["kvcmas", "latency_s"] == pytest.approx(1.2) and t1.loc["kvcmas", "ttft_s"] == pytest.approx(0.12)
    assert t1.loc["kvcmas", "method_state_bytes"] == 4 * 2**20
    assert t1.loc["kvcmas", "kv_rel_error"] == pytest.approx(0.08)  # the mean over every reused shared segment
    # best and second-best accuracy among the sharing methods (NonShared is never marked)
    assert t1.loc["kvcmas", "acc_mark"] == "best"
    assert t1.loc["cacheblend rho=0.5", "acc_mark"] == "second"
    assert t1.loc["nonshared", "acc_mark"] == "" and t1.loc["fullshared", "acc_mark"] == ""
    # rows: NonShared, FullShared first
    assert list(t1.index[:2]) == ["nonshared", "fullshared"]


def test_agreement_with_nonshared(matrix, t1):
    assert t1.loc["nonshared", "answer_agreement"] == 1.0 and t1.loc["nonshared", "first_token_agreement"] == 1.0
    assert t1.loc["fullshared", "answer_agreement"] == pytest.approx(3 / 6)
    assert t1.loc["kvcmas", "answer_agreement"] == pytest.approx(5 / 6)
    assert t1.loc["cacheblend rho=0.5", "answer_agreement"] == 1.0
    # first tokens: FullShared's second request differs on every sample, KVCMAS's on one
    assert t1.loc["fullshared", "first_token_agreement"] == pytest.approx(0.5)
    assert t1.loc["kvcmas", "first_token_agreement"] == pytest.approx(11 / 12)
    res = load_dirs([matrix["nonshared"], matrix["kvcmas"]])
    ns, kv = res.runs
    assert reference_for(kv, res.runs) is ns and reference_for(ns, res.runs) is ns
    per_sample = sample_agreement(kv, ns)
    assert per_sample.set_index("sample_id").loc["mmlu-5", "agree"] == False  # noqa: E712
    assert len(request_agreement(kv, ns)) == 12


def test_no_agreement_without_a_nonshared_run_over_the_same_samples(matrix, tmp_path):
    other = make_run(tmp_path / "ns-seed1", "nonshared", ["A"] * 6, seed=1)
    t = table1(load_dirs([other, matrix["kvcmas"]])).set_index("label")
    assert pd.isna(t.loc["kvcmas", "answer_agreement"])


# ---- figures -------------------------------------------------------------------------------------
def _gids(ax, prefix):
    return {a.get_gid()[len(prefix) :]: a for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)}


def test_pareto_plot_holds_points_frontier_region_and_clamped_outlier(t1):
    df = t1.reset_index()
    fig, ax = pareto_axes(df, "latency_s", "accuracy", "t")
    points = _gids(ax, "point:")
    assert set(points) == {"nonshared", "fullshared", "kvcmas", "cacheblend rho=0.9"}
    assert tuple(points["kvcmas"].get_offsets()[0]) == pytest.approx((1.2, 5 / 6))
    # frontier (min latency, max accuracy): FullShared then KVCMAS; NonShared and CacheBlend dominated
    (line,) = [a for a in ax.get_lines() if a.get_gid() == "frontier"]
    assert list(line.get_xdata()) == pytest.approx([1.0, 1.2])
    assert list(line.get_ydata()) == pytest.approx([2 / 6, 5 / 6])
    assert line.get_drawstyle() == "steps-post"
    # the region between FullShared (1.0 s, 2/6) and NonShared (2.0 s, 4/6)
    (region,) = [p for p in ax.patches if p.get_gid() == "baseline-region"]
    assert (region.get_x(), region.get_width()) == pytest.approx((1.0, 1.0))
    assert (region.get_y(), region.get_height()) == pytest.approx((2 / 6, 2 / 6))
    # CacheBlend rho=0.5 at 50 s lies far outside: drawn on the right border, labelled with its values
    clamped = _gids(ax, "clamped:")
    assert set(clamped) == {"cacheblend rho=0.5"}
    x, y = clamped["cacheblend rho=0.5"].get_offsets()[0]
    assert x == pytest.approx(ax.get_xlim()[1]) and y == pytest.approx(4 / 6)
    label = _gids(ax, "label:")["cacheblend rho=0.5"]
    assert "50" in label.get_text() and "0.667" in label.get_text()
    assert ax.get_xlabel() == "E2E latency per sample (s)"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_frontier_rule():
    assert frontier([(3, 0.5), (1, 0.2), (2, 0.6), (2, 0.1), (4, 0.6)]) == [(1, 0.2), (2, 0.6)]


def test_accuracy_vs_rho_view(t1):
    fig, ax = rho_axes(t1.reset_index(), "accuracy", "t")
    lines = {a.get_gid(): a for a in ax.get_lines() if a.get_gid()}
    cb = lines["rho:cacheblend"]
    assert list(cb.get_xdata()) == pytest.approx([0.5, 0.9])
    assert list(cb.get_ydata()) == pytest.approx([4 / 6, 3 / 6])
    assert lines["nonshared-ref"].get_ydata()[0] == pytest.approx(4 / 6)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_sweep_figure_rings_saturated_points(matrix, tmp_path, monkeypatch):
    import numpy as np

    from kvcmas_bench.serving import plots

    rows = json.loads((matrix["sweep"] / "summary.json").read_text())["rows"]
    kept = []
    monkeypatch.setattr(plots.plt, "close", kept.append)  # keep the figure to read its artists
    plots.plot_ttft(rows, tmp_path / "t.png", "p50", note="tiny-model on cpu")
    ax = kept[0].axes[0]
    (ring,) = [c for c in ax.collections if c.get_gid() == "saturated"]
    # both methods are saturated at QPS 8 (the third category), nowhere else
    assert np.asarray(ring.get_offsets()) == pytest.approx(np.array([[2, 0.9], [2, 0.9]]))
    assert "saturated (utilization >= 1)" in [t.get_text() for t in kept[0].legends[0].get_texts()]
    assert (tmp_path / "t.png").exists() and (tmp_path / "t.svg").exists()
    monkeypatch.undo()
    plots.plt.close(kept[0])


# ---- the report job --------------------------------------------------------------------------------
def test_report_writes_every_table_and_figure(matrix, tmp_path):
    out = tmp_path / "rep"
    res = build_report(list(matrix.values()), out, ["md", "html", "csv", "parquet"])
    names = {f.name for f in res.figures}
    for y in ("accuracy", "answer_agreement"):
        for x in ("latency", "ttft", "rho"):
            assert f"mmlu_{y}_vs_{x}" in names
    assert {"sweep_ttft_p50", "sweep_ttft_p90"} <= names
    for f in res.figures:
        assert f.png.stat().st_size > 0 and f.svg.read_text().lstrip().startswith("<?xml")
    html = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    assert html.count("<table>") == 2 and html.count("data:image/png;base64,") == len(res.figures)
    for text in (html, md):
        assert "Table 1: mmlu" in text and "serve-sweep" in text
        for label in ("nonshared", "fullshared", "kvcmas", "cacheblend rho=0.5", "cacheblend rho=0.9"):
            assert f">{label}<" in text or f"| {label} |" in text
        assert "agree w/ NonShared" in text and "saturated" in text and "KV rel. error" in text
    assert "<b>0.833</b>" in html and "**0.833**" in md
    for name in ("table1", "runs", "samples", "requests", "agreement", "sweeps"):
        assert len(pd.read_csv(out / f"{name}.csv")) > 0
        assert len(pd.read_parquet(out / f"{name}.parquet")) > 0
    assert len(pd.read_csv(out / "agreement.csv")) == 30


def test_report_cli_and_bad_inputs(matrix, tmp_path, capsys):
    assert run_cli(["report", str(matrix["kvcmas"]), str(matrix["nonshared"]), "-o", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.html").exists()
    assert run_cli(["report", str(matrix["sweep"]), "-o", str(tmp_path / "s")]) == 0  # a sweep alone
    assert (tmp_path / "s" / "figures" / "sweep_ttft_p50.svg").exists()
    assert run_cli(["report", str(tmp_path / "nope")]) == 2
    assert run_cli(["report", str(matrix["kvcmas"]), "--format", "pdf"]) == 2
    bad = make_run(tmp_path / "bad", "kvcmas", ["A", "B"])
    with open(bad / "samples.jsonl", "a") as f:
        f.write("{not json\n" + json.dumps({"sample_id": "x", "correct": True}) + "\n")
    with pytest.raises(BenchError, match="corrupt"):
        load_dirs([bad])
    capsys.readouterr()
    assert run_cli(["report", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 3 is not JSON" in err[0]


# ---- console at 80 columns -------------------------------------------------------------------------
def test_console_tables_fit_80_columns(matrix, tmp_path):
    from kvcmas_bench.console import print_run_summary, print_sweep_table

    res = build_report(list(matrix.values()), tmp_path / "rep", ["md"], plots=False)
    con = narrow()
    console_table1(res, con)
    summary = json.loads((matrix["sweep"] / "summary.json").read_text())
    print_sweep_table(summary, con)
    run_summary = {
        "method": "kvcmas-nonchained",
        "workload": "mmlu",
        "model": "smollm2-135m-instruct",
        "device": "cpu",
        "n": 10,
        "accuracy": 0.3,
        "latency_s": 12.3456,
        "ttft_s": 0.7782,
        "ttft_s_p90": 1.0201,
        "peak_mem_bytes": 1319567360,
        "kv_state_peak_bytes": 77322240,
        "reuse_ratio": 0.8123,
        "fidelity": {"top1_agree": 1.0, "first_token_kl": 5e-8, "kv_rel_error": 0.01},
    }
    print_run_summary(run_summary, con)
    text = con.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for needle in ("kvcmas-nonchained", "1258.4", "cacheblend", "0.833", "nonshared"):
        assert needle in text
    # the saturated sweep points are flagged, with the QPS NonShared sustains
    assert "17.00!" in text and "saturated" in text and "NonShared sustains < 0.471 QPS" in text


def test_accounting_shows_a_counter_that_repeats_a_status_count_once():
    from types import SimpleNamespace

    from kvcmas_bench.jobs.report import accounting_section

    graphflow = {"corrected": 100, "segments": {"corrected": 100, "exact": 3}}
    kvcmas = {"accepted": 59, "corrected": 2, "segments": {"corrected": 59, "exact": 41}}  # 2 != 59: kept
    runs = [
        SimpleNamespace(run_id="mmlu/graphflow", summary={"accounting": graphflow}),
        SimpleNamespace(run_id="mmlu/kvcmas", summary={"accounting": kvcmas}),
    ]
    sec = accounting_section(SimpleNamespace(runs=runs))
    assert sec.rows[0] == {"run": "mmlu/graphflow", "segments corrected": 100, "segments exact": 3}
    assert sec.rows[1] == {
        "run": "mmlu/kvcmas",
        "accepted": 59,
        "corrected": 2,
        "segments corrected": 59,
        "segments exact": 41,
    }
