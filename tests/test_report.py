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
from kvcmas_bench.report.tables import mark_best, reference_for, request_agreement, sample_agreement, table1
from kvcmas_bench.results.frames import dir_kind, load_dirs, read_jsonl

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
    assert t1.loc["kvcmas", "latency_mean_s"] == pytest.approx(1.2)
    assert t1.loc["kvcmas", "ttft_mean_s"] == pytest.approx(0.12)
    assert t1.loc["kvcmas", "method_state_peak_bytes"] == 4 * 2**20
    assert t1.loc["kvcmas", "kv_rel_error"] == pytest.approx(0.08)  # the one shared segment per sample
    # accuracy 5/6: binomial SE sqrt(5/6 * 1/6 / 6) and the Wilson interval (roots solved by hand)
    assert t1.loc["kvcmas", "accuracy_se"] == pytest.approx(0.152145, abs=1e-6)
    assert t1.loc["kvcmas", "accuracy_ci_low"] == pytest.approx(0.436497, abs=1e-6)
    assert t1.loc["kvcmas", "accuracy_ci_high"] == pytest.approx(0.969947, abs=1e-6)
    # answer agreement 5/6 and first-token agreement 11/12 carry theirs too
    assert t1.loc["kvcmas", "answer_agreement_ci_low"] == pytest.approx(0.436497, abs=1e-6)
    assert t1.loc["kvcmas", "first_token_agreement_se"] == pytest.approx((11 / 12 / 12 / 12) ** 0.5)
    assert t1.loc["kvcmas", "first_token_agreement_ci_low"] == pytest.approx(0.646120, abs=1e-6)
    # against NonShared on the same samples: KVCMAS right on mmlu-5 where NonShared is wrong (b=1, c=0):
    # p = 2 * 0.5 = 1; FullShared wrong on mmlu-1, mmlu-2 where NonShared is right (b=0, c=2): p = 2 * 0.25
    assert t1.loc["kvcmas", "accuracy_delta"] == pytest.approx(1 / 6)
    assert (t1.loc["kvcmas", "mcnemar_b"], t1.loc["kvcmas", "mcnemar_c"], t1.loc["kvcmas", "mcnemar_p"]) == (1, 0, 1)
    assert t1.loc["fullshared", "accuracy_delta"] == pytest.approx(-2 / 6)
    assert t1.loc["fullshared", "mcnemar_p"] == pytest.approx(0.5)
    assert pd.isna(t1.loc["nonshared", "mcnemar_p"])
    # 6 samples separate nothing: the best (5/6) is not significantly above FullShared (2/6: b=3, c=0,
    # p = 0.25), so every sharing method ties for the best and nothing is marked best or second
    for label in ("fullshared", "kvcmas", "cacheblend rho=0.5", "cacheblend rho=0.9"):
        assert t1.loc[label, "acc_mark"] == "tied", label
    assert t1.loc["nonshared", "acc_mark"] == ""  # NonShared is never marked
    assert set(t1["n"]) == {6} and set(t1["sample_scope"]) == {"all"}
    # rows: NonShared, FullShared first
    assert list(t1.index[:2]) == ["nonshared", "fullshared"]


def test_mark_rule_needs_significance_against_every_other_method():
    right, wrong = True, False
    # 6 of 6 against 0 of 6: b = 6, c = 0, p = 2 * 0.5**6 = 0.03125 < 0.05: best, and the other second
    assert mark_best({"a": [right] * 6, "b": [wrong] * 6}) == {"a": "best", "b": "second"}
    # 5 discordant pairs only: p = 0.0625: they tie
    assert mark_best({"a": [right] * 5 + [wrong], "b": [wrong] * 6}) == {"a": "tied", "b": "tied"}
    # a beats c (p = 0.03125) but not b (5 discordant, p = 0.0625): a and b tie, c unmarked
    outcomes = {
        "c": [wrong] * 6 + [right] * 4,
        "a": [right] * 10,
        "b": [right] + [wrong] * 5 + [right] * 4,
    }
    assert mark_best(outcomes) == {"a": "tied", "b": "tied"}
    # a beats both (6 discordant each), b and c equal below it (b = c, p = 1): a best, no second
    outcomes = {"a": [right] * 12, "b": [right] * 6 + [wrong] * 6, "c": [wrong] * 6 + [right] * 6}
    assert mark_best(outcomes) == {"a": "best", "b": "tied-second", "c": "tied-second"}
    # a stricter level separates nothing; fewer than two methods: no marks
    assert mark_best({"a": [right] * 6, "b": [wrong] * 6}, alpha=0.01) == {"a": "tied", "b": "tied"}
    assert mark_best({"a": [right] * 6}) == {}


def test_best_mark_where_the_difference_is_significant(tmp_path):
    ns = make_run(tmp_path / "ns", "nonshared", ["A", "B", "C", "D", "A", "B"])  # 6/6
    kv = make_run(tmp_path / "kv", "kvcmas", ["A", "B", "C", "D", "A", "B"])  # 6/6
    fs = make_run(tmp_path / "fs", "fullshared", ["B", "C", "D", "A", "B", "C"])  # 0/6
    res = build_report([ns, kv, fs], tmp_path / "rep", ["md", "html"], plots=False)
    t = res.table1.set_index("label")
    assert t.loc["kvcmas", "acc_mark"] == "best" and t.loc["fullshared", "acc_mark"] == "second"
    assert t.loc["fullshared", "mcnemar_p"] == pytest.approx(2 * 0.5**6)
    md, html = (tmp_path / "rep" / "report.md").read_text(), (tmp_path / "rep" / "report.html").read_text()
    # 6/6: Wilson [6 / (6 + z^2), 1] = [0.610, 1]; 0/6: [0, z^2 / (6 + z^2)] = [0, 0.390]
    assert "**1.000 ± 0.000 [0.610, 1.000]**" in md and "_0.000 ± 0.000 [0.000, 0.390]_" in md
    assert "<b>1.000 ± 0.000 [0.610, 1.000]</b>" in html
    assert "exact McNemar p < 0.05 against each" in md


def test_table1_compares_only_the_samples_every_run_finished(tmp_path, capsys):
    ns = make_run(tmp_path / "ns", "nonshared", ["A", "B", "C", "D", "B", "A"])  # 4/6; 4/4 on mmlu-0..3
    kv = make_run(tmp_path / "kv", "kvcmas", ["A", "B", "C", "D", "B", "B"], first_tokens=[(7, 8)] * 5 + [(7, 9)])
    fs = make_run(tmp_path / "fs", "fullshared", ["A", "C", "D", "D"])  # stopped after 4 samples: 2/4
    res = build_report([ns, kv, fs], tmp_path / "rep", ["md", "csv"], plots=False)
    t = res.table1.set_index("label")
    # every figure over mmlu-0..3, the samples all three finished; n is the common n
    assert set(t["n"]) == {4} and set(t["sample_scope"]) == {"common"}
    assert t.loc["nonshared", "n_finished"] == 6 and t.loc["fullshared", "n_finished"] == 4
    assert t.loc["nonshared", "accuracy"] == 1.0 and t.loc["kvcmas", "accuracy"] == 1.0
    assert t.loc["fullshared", "accuracy"] == pytest.approx(0.5)
    # KVCMAS's one differing first token is on mmlu-5, outside the common samples
    assert t.loc["kvcmas", "first_token_agreement"] == 1.0 and t.loc["kvcmas", "agreement_samples"] == 4
    assert t.loc["kvcmas", "paired_samples"] == 4 and t.loc["kvcmas", "accuracy_delta"] == 0.0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Table 1: mmlu (tiny-model on cpu; n = 4)" in md
    assert "Compared over the 4 samples every run of this table finished" in md
    assert "nonshared 6, kvcmas 6" in md
    assert list(pd.read_csv(tmp_path / "rep" / "table1.csv")["n"]) == [4, 4, 4]


def test_runs_sharing_no_sample_are_each_over_their_own_and_unmarked(tmp_path):
    a = make_run(tmp_path / "a", "kvcmas", ["A", "B", "C", "D", "A", "B"])
    b = make_run(tmp_path / "b", "fullshared", ["B", "C", "D", "A", "B", "C"])
    rows = [json.loads(line) for line in (b / "samples.jsonl").read_text().splitlines()]
    reqs = read_jsonl(b / "requests.jsonl")
    for r in [*rows, *reqs]:
        r["sample_id"] = r["sample_id"].replace("mmlu-", "mmlu-1")
    (b / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (b / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    res = build_report([a, b], tmp_path / "rep", ["md"], plots=False)
    t = res.table1.set_index("label")
    assert set(t["sample_scope"]) == {"own"} and set(t["n"]) == {6} and set(t["acc_mark"]) == {""}
    assert t.loc["kvcmas", "accuracy"] == 1.0 and t.loc["fullshared", "accuracy"] == 0.0
    assert "share no finished sample" in (tmp_path / "rep" / "report.md").read_text()


def test_summary_and_table1_take_every_figure_from_one_definition(tmp_path):
    """The KV error counts every shared segment, an exactly prefilled one as 0 (summary.json's
    definition): the dense first agent's exact segment (error 0) and the reused one (0.1 * rho)."""
    from kvcmas_bench.results.request import RequestRecord
    from kvcmas_bench.results.summary import summarize

    d = make_run(tmp_path / "kv", "kvcmas", ["A", "B", "C", "D", "B", "B"], rho=0.8, fidelity=True, state=2**20)
    reqs = read_jsonl(d / "requests.jsonl")
    for r in reqs:
        if r["step"] == 0:
            r["segments"] = [{"kind": "PH", "tokens": 10, "status": "exact", "slot": "q", "kv_rel_error": 0.0}]
    (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    samples = read_jsonl(d / "samples.jsonl")
    summary = summarize(samples, [RequestRecord.from_dict(r) for r in reqs], {"method": "kvcmas"})
    (d / "summary.json").write_text(json.dumps(summary))
    row = table1(load_dirs([d])).iloc[0]
    assert summary["fidelity"]["kv_rel_error"] == pytest.approx((0.0 + 0.08) / 2)  # not 0.08: the exact one counts
    assert row["kv_rel_error"] == summary["fidelity"]["kv_rel_error"]
    for key in (
        "n",
        "accuracy",
        "accuracy_se",
        "accuracy_ci_low",
        "accuracy_ci_high",
        "latency_mean_s",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "e2e_mean_s",
        "peak_mem_bytes",
        "kv_state_peak_bytes",
        "method_state_peak_bytes",
        "reuse_ratio",
    ):
        assert row[key] == summary[key], key
    for key in ("top1_agree", "top1_agree_se", "top1_agree_ci_low", "first_token_kl"):
        assert row[key] == summary["fidelity"][key], key
    assert summary["method_state_peak_bytes"] == 2**20 and summary["ttft_p90_s"] == pytest.approx(0.1)
    # one name per figure: the names used before the scheme are gone from both
    assert "method_state_bytes" not in summary and "ttft_s_p90" not in row
    # the runs frame (summary.json, flattened) carries the same figure under the same name
    runs = load_dirs([d]).runs_frame()
    assert runs["kv_rel_error"].iloc[0] == row["kv_rel_error"]
    assert runs["accuracy_ci_high"].iloc[0] == row["accuracy_ci_high"]


def test_accuracy_across_repeats(tmp_path):
    """Three seeds of NonShared and KVCMAS: one Table 1 per seed, and mean and standard deviation
    (divisor n - 1) of each method's accuracy across them."""
    dirs = []
    kv_preds = (["A", "B", "C", "D", "B", "B"], ["A", "B", "C", "C", "B", "B"], ["A", "B", "A", "A", "B", "B"])
    for seed, preds in enumerate(kv_preds):  # KVCMAS 5/6, 4/6, 3/6
        dirs.append(make_run(tmp_path / f"ns{seed}", "nonshared", ["A", "B", "C", "D", "B", "A"], seed=seed))
        dirs.append(make_run(tmp_path / f"kv{seed}", "kvcmas", preds, seed=seed))
    res = build_report(dirs, tmp_path / "rep", ["md", "csv"], plots=False)
    assert list(dict.fromkeys(res.table1["table"])) == ["mmlu, seed=0", "mmlu, seed=1", "mmlu, seed=2"]
    rep = res.repeats.set_index("label")
    assert rep.loc["kvcmas", "repeats"] == 3 and rep.loc["kvcmas", "seeds"] == "0,1,2"
    assert rep.loc["kvcmas", "accuracy_mean"] == pytest.approx(4 / 6)
    assert rep.loc["kvcmas", "accuracy_std"] == pytest.approx(1 / 6)  # sqrt(((1/6)^2 + 0 + (1/6)^2) / 2)
    assert rep.loc["nonshared", "accuracy_mean"] == pytest.approx(4 / 6) and rep.loc["nonshared", "accuracy_std"] == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Accuracy across repeats: mmlu" in md and "| kvcmas | 3 | 0,1,2 | 6 | 0.667 | 0.167 |" in md
    assert "Table 1: mmlu, seed=2" in md
    assert len(pd.read_csv(tmp_path / "rep" / "repeats.csv")) == 2


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
    fig, ax = pareto_axes(df, "latency_mean_s", "accuracy", "t")
    points = _gids(ax, "point:")
    assert set(points) == {"nonshared", "fullshared", "kvcmas", "cacheblend rho=0.9"}
    assert tuple(points["kvcmas"].get_offsets()[0]) == pytest.approx((1.2, 5 / 6))
    # accuracy 5/6 with its 95% Wilson interval as an error bar
    bar = _gids(ax, "ci:")["kvcmas"]
    assert list(bar.get_xdata()) == pytest.approx([1.2, 1.2])
    assert list(bar.get_ydata()) == pytest.approx([0.436497, 0.969947], abs=1e-6)
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
    # Table 1, the accounting (summed from the request records) and the sweep
    assert html.count("<table>") == 3 and html.count("data:image/png;base64,") == len(res.figures)
    assert "Method accounting (from the request records)" in md
    for text in (html, md):
        assert "Table 1: mmlu" in text and "serve-sweep" in text
        for label in ("nonshared", "fullshared", "kvcmas", "cacheblend rho=0.5", "cacheblend rho=0.9"):
            assert f">{label}<" in text or f"| {label} |" in text
        assert "agree w/ NonShared" in text and "saturated" in text and "KV rel. error" in text
    # 6 samples separate no method: no mark, the tie said in words
    assert "<b>" not in html.split("<h2>Figures")[0] and "**" not in md
    for text in (html, md):
        assert "tie for the best accuracy" in text and "0.833 ± 0.152 [0.436, 0.970]" in text
    t1 = pd.read_csv(out / "table1.csv")
    for col in ("accuracy_se", "accuracy_ci_low", "accuracy_ci_high", "answer_agreement_se", "mcnemar_p"):
        assert col in t1 and t1[col].notna().any(), col
    assert set(pd.read_parquet(out / "table1.parquet").columns) == set(t1.columns)
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
        "latency_mean_s": 12.3456,
        "ttft_mean_s": 0.7782,
        "ttft_p90_s": 1.0201,
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
    from kvcmas_bench.results.request import RequestRecord, SegmentRecord

    def records(stats: dict, statuses: dict) -> list:
        """One request per status count (its shared segments), the counters on the first."""
        segs = [SegmentRecord("PH", 4, status=k) for k, n in statuses.items() for _ in range(n)]
        return [RequestRecord("A", 0.1, 0.2, segments=segs, method_stats=stats)]

    # summed from the request records, not read from summary.json (which says nothing here)
    runs = [
        SimpleNamespace(
            run_id="mmlu/graphflow", summary={}, records=records({"corrected": 100}, {"corrected": 100, "exact": 3})
        ),
        SimpleNamespace(
            run_id="mmlu/kvcmas",
            summary={"accounting": {"accepted": 1}},
            records=records({"accepted": 59, "corrected": 2}, {"corrected": 59, "exact": 41}),  # 2 != 59: kept
        ),
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


def test_two_nonshared_runs_on_a_batching_engine_give_every_agreement_its_noise_floor(tmp_path):
    """NonShared on vLLM at concurrency 8 and 1: same answers, first tokens differing on 3 of 6
    samples' second requests, so the floor agrees on 6/6 answers and 9/12 first tokens. KVCMAS (c8)
    agrees on 5/6 answers: 1 discordant pair, McNemar p = 1, within noise. FullShared (c8) agrees
    on none: 6 discordant pairs, p = 2 x 0.5^6 = 0.031 < 0.05, below noise. Each is compared with the
    NonShared run on its own engine and concurrency."""
    vllm = "vllm server (vllm serve + KVCMASConnector, samples batched by vLLM)"
    gold = ["A", "B", "C", "D", "A", "B"]
    c8, c1 = dict(engine=vllm, max_concurrency=8), dict(engine=vllm, max_concurrency=1)
    ns8 = make_run(tmp_path / "ns8", "nonshared", gold, **c8)
    ns1 = make_run(tmp_path / "ns1", "nonshared", gold, first_tokens=[(7, 9)] * 3 + [(7, 8)] * 3, **c1)
    kv = make_run(tmp_path / "kv", "kvcmas", ["A", "B", "C", "D", "A", "C"], **c8)
    fs = make_run(tmp_path / "fs", "fullshared", ["B", "C", "D", "A", "B", "C"], **c8)
    res = build_report([ns8, ns1, kv, fs], tmp_path / "rep", ["md"], plots=False)
    t = res.table1.set_index("label")
    assert set(t.index) == {"nonshared max_concurrency=8", "nonshared max_concurrency=1", "kvcmas", "fullshared"}
    assert (t["noise_answer_agreement"] == 1.0).all() and (t["noise_first_token_agreement"] == 0.75).all()
    assert t.loc["kvcmas", "reference"] == t.loc["nonshared max_concurrency=8", "run_id"]
    assert t.loc["kvcmas", "answer_agreement"] == pytest.approx(5 / 6)
    assert t.loc["kvcmas", "agreement_vs_noise"] == "within noise"
    assert t.loc["fullshared", "answer_agreement"] == 0.0
    assert t.loc["fullshared", "agreement_vs_noise"] == "below noise"
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Noise floor: NonShared against itself" in md and "1.000 ± 0.000 of answers and 0.750 of first" in md
    assert "Agreement with NonShared within noise" in md and "below noise" in md
    # one engine that runs one request at a time: no floor, nothing marked
    solo = build_report([make_run(tmp_path / "a", "nonshared", gold), make_run(tmp_path / "b", "kvcmas", gold)],
                        tmp_path / "rep2", ["md"], plots=False).table1  # fmt: skip
    assert "noise_answer_agreement" not in solo and "agreement_vs_noise" not in solo
