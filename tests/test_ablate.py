"""ablate: every sweep end to end on a tiny random-weight model (tables, figures and the plotted
series), resume without redoing finished points, `report` over an ablation directory, and every
option checked before a model loads."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from kvcmas_bench.analysis.ablation import pareto_figure, sweep_figure
from kvcmas_bench.jobs import run as runner

from .conftest import run_cli


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def args(kind: str, model: str, out, *extra: str, limit: int = 2) -> list[str]:
    return [
        "ablate",
        kind,
        "--model",
        model,
        "--device",
        "cpu",
        "--limit",
        str(limit),
        "--max-new-tokens",
        "3",
        "--final-max-new-tokens",
        "2",
        "-o",
        str(out),
        *extra,
    ]


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {ln.get_gid(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines() if ln.get_gid()}


@pytest.fixture(scope="module")
def tau_sweep(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate") / "tau"
    extra = ("--values", "0.2,1", "--methods", "kvcmas,cacheblend", "--rhos", "0.5,0.9")
    assert run_cli(args("tau", tiny_model_dir, out, *extra, limit=3)) == 0  # 3 samples: the third is gated
    return out


def test_tau_sweep_writes_its_table_and_figures(tau_sweep):
    t = pd.read_csv(tau_sweep / "ablate-tau.csv")
    # NonShared once, KVCMAS at every gate x tau, CacheBlend at every rho
    assert sorted(t["point"]) == sorted(
        [
            "nonshared",
            "kvcmas-paper-tau0.2",
            "kvcmas-paper-tau1",
            "kvcmas-scaled-tau0.2",
            "kvcmas-scaled-tau1",
            "cacheblend-rho0.5",
            "cacheblend-rho0.9",
        ]
    )
    assert (t["n"] == 3).all() and (t["answer_agreement"].notna()).all()
    k = t[t["method"] == "kvcmas"].set_index("point")
    assert {"gate", "tau", "reuse_ratio", "kv_rel_error", "ttft_mean_s", "first_token_agreement"} <= set(t.columns)
    # tau = 1 accepts every gated decision: at least the reuse of tau = 0.2, under each gate
    for gate in ("paper", "scaled"):
        lo, hi = k.loc[f"kvcmas-{gate}-tau0.2"], k.loc[f"kvcmas-{gate}-tau1"]
        assert hi["reuse_ratio"] >= lo["reuse_ratio"] and hi["gate_accept_share"] == 1.0
    for f in ("mmlu_tau.png", "mmlu_tau.svg", "mmlu_tau_pareto.png", "mmlu_gate_replay.png"):
        assert (tau_sweep / "figures" / f).exists()
    # both gates replayed on the recorded decisions: accepted share non-decreasing in tau, all at tau 1
    rep = pd.read_csv(tau_sweep / "gate-replay-mmlu.csv")
    assert set(rep["gate"]) == {"paper", "scaled"} and (rep["decisions"] > 0).all()
    for _, g in rep.groupby("gate"):
        assert g["accepted_share"].is_monotonic_increasing and g["accepted_share"].iloc[-1] == 1.0
    md = (tau_sweep / "ablate-tau.md").read_text()
    assert "ablate tau: mmlu" in md and "kvcmas" in md and "figures/mmlu_tau_pareto.png" in md
    # every point is an ordinary run directory that records its gate
    cfg = json.loads((tau_sweep / "mmlu" / "kvcmas-scaled-tau0.2" / "config.json").read_text())
    assert cfg["method_config"]["gate_mode"] == "scaled" and cfg["method_config"]["tau"] == 0.2
    assert cfg["method_config"]["svd"] == "auto" and cfg["method_resolved"] == {"svd": "gram"}  # on the CPU


def test_tau_figures_plot_the_table(tau_sweep):
    t = pd.read_csv(tau_sweep / "ablate-tau.csv")
    fig, axes = sweep_figure(t, "tau", "t")
    rho = _lines(axes[0])
    assert set(rho) == {"reuse_ratio:kvcmas paper", "reuse_ratio:kvcmas scaled"}  # recomputation: no tau
    for gate in ("paper", "scaled"):
        g = t[(t["method"] == "kvcmas") & (t["gate"] == gate)].sort_values("tau")
        assert rho[f"reuse_ratio:kvcmas {gate}"] == (list(g["tau"]), list(g["reuse_ratio"]))
        assert _lines(axes[2])[f"kv_rel_error:kvcmas {gate}"][1] == list(g["kv_rel_error"])
    plt.close(fig)
    fig, axes = pareto_figure(t, "p")
    pareto = _lines(axes[0])
    assert set(pareto) == {
        "pareto-kv_rel_error:kvcmas paper",
        "pareto-kv_rel_error:kvcmas scaled",
        "pareto-kv_rel_error:cacheblend",
    }
    cb = t[t["method"] == "cacheblend"].sort_values("reuse_ratio")
    assert pareto["pareto-kv_rel_error:cacheblend"] == (list(cb["reuse_ratio"]), list(cb["kv_rel_error"]))
    plt.close(fig)


def test_report_reads_an_ablation_directory(tau_sweep, tmp_path):
    from kvcmas_bench.jobs.report import build_report

    res = build_report([tau_sweep], tmp_path / "rep", ["md"], plots=False)
    t1 = res.table1
    assert len(t1) == 7 and set(t1["method"]) == {"nonshared", "kvcmas", "cacheblend"}
    assert t1["answer_agreement"].notna().all()  # NonShared over the same samples is the reference
    assert "kvcmas gate_mode=scaled tau=0.2" in set(t1["label"])


def test_ablation_resumes_without_redoing_finished_points(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "anchors"
    cmd = args("anchors", tiny_model_dir, out, "--values", "1,5")
    real_one, real_prepare = runner.run_one, runner.prepare
    calls = {"one": 0, "prepare": 0}

    def one(*a, **kw):
        calls["one"] += 1
        if calls["one"] == 4:  # NonShared's 2 samples, V=1's first, then Ctrl-C
            raise KeyboardInterrupt
        return real_one(*a, **kw)

    def prepare(*a, **kw):
        calls["prepare"] += 1
        return real_prepare(*a, **kw)

    monkeypatch.setattr(runner, "run_one", one)
    monkeypatch.setattr(runner, "prepare", prepare)
    assert run_cli(cmd) == 130
    cells = json.loads((out / "suite.json").read_text())["cells"]
    assert cells["mmlu/nonshared"]["status"] == "done" and cells["mmlu/kvcmas-V1"]["status"] == "running"
    calls.update(one=0, prepare=0)
    assert run_cli(cmd) == 0
    assert calls == {"one": 3, "prepare": 2}  # V=1's missing sample, then V=5's two
    t = pd.read_csv(out / "ablate-anchors.csv").set_index("point")
    assert list(t.loc[["kvcmas-V1", "kvcmas-V5"], "V"]) == [1, 5]
    calls.update(one=0, prepare=0)
    assert run_cli(cmd) == 0 and calls == {"one": 0, "prepare": 0}
    # more values later: only the new point runs; other settings are refused
    assert run_cli(args("anchors", tiny_model_dir, out, "--values", "1,5,2")) == 0
    assert calls == {"one": 2, "prepare": 1}
    t = pd.read_csv(out / "ablate-anchors.csv")  # the table covers every point of the directory
    assert list(t["point"]) == ["nonshared", "kvcmas-V1", "kvcmas-V5", "kvcmas-V2"]
    fig, axes = sweep_figure(t, "anchors", "t")
    k = t[t["method"] == "kvcmas"].sort_values("V")
    assert _lines(axes[2])["reuse_ratio:kvcmas"] == ([1, 2, 5], list(k["reuse_ratio"]))
    plt.close(fig)
    assert (out / "figures" / "mmlu_anchors.png").exists()
    assert run_cli([*cmd, "--seed", "3"]) == 2


@pytest.mark.parametrize(
    "kind,extra,points,x",
    [
        (
            "rank",
            ["--values", "2,8", "--delta-ranks", "4", "--warmup", "3"],
            ["kvcmas-r2-4", "kvcmas-r8-4"],
            ["2/4", "8/4"],
        ),
        ("agents", ["--values", "2,3", "--methods", "kvcmas", "--warmup", "3"], ["kvcmas-A2", "kvcmas-A3"], [2, 3]),
        ("rounds", ["--values", "1,2", "--methods", "fullshared"], ["fullshared-R1", "fullshared-R2"], [1, 2]),
    ],
)
def test_rank_agents_and_rounds_sweeps(tiny_model_dir, tmp_path, kind, extra, points, x):
    out = tmp_path / kind
    assert run_cli(args(kind, tiny_model_dir, out, *extra)) == 0
    t = pd.read_csv(out / f"ablate-{kind}.csv", dtype={"r_C": str, "r_D": str})
    assert set(points) <= set(t["point"]) and t["answer_agreement"].notna().all()
    assert (out / "figures" / f"mmlu_{kind}.png").exists()
    fig, axes = sweep_figure(t.assign(**({"r_C": t["r_C"], "r_D": t["r_D"]} if kind == "rank" else {})), kind, "t")
    method = points[0].split("-")[0]
    metric = {"rank": "answer_agreement", "agents": "ttft_mean_s", "rounds": "ttft_mean_s"}[kind]
    ax = axes[0]
    xs, ys = _lines(ax)[f"{metric}:{method}"]
    assert xs == x
    assert ys == pytest.approx(list(t.set_index("point").loc[points, metric]))
    plt.close(fig)
    if kind in ("agents", "rounds"):  # NonShared once per workflow setting: its own line
        assert len(t[t["method"] == "nonshared"]) == 2
        cfg = json.loads((out / "mmlu" / points[1] / "config.json").read_text())
        assert (cfg["n_agents"], cfg["rounds"]) == ((3, 1) if kind == "agents" else (4, 2))
    else:
        cfg = json.loads((out / "mmlu" / points[0] / "config.json").read_text())
        assert (cfg["method_config"]["rank"], cfg["method_config"]["delta_rank"]) == (2, 4)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["nope"], "unknown ablation"),
        (["rank", "--gates", "scaled"], "--gates applies to ablate tau"),
        (["rank", "--methods", "kvcomm"], "has no option 'rank'"),
        (["rank", "--values", "x"], "--values takes"),
        (["tau", "--gates", "soft"], "--gates takes"),
        (["tau", "--rhos", "1.5"], "--rhos must lie"),
        (["anchors", "--values", "0"], "--anchors must be a positive integer"),
        (["tau", "--values", "2"], "--tau must lie in [0, 1]"),
        (["agents", "--values", "99"], "--agents must lie"),
        (["tau", "--method-arg", "bogus=1"], "unknown method option 'bogus'"),
    ],
)
def test_everything_is_checked_before_a_model_loads(tmp_path, monkeypatch, capsys, extra, needle):
    import kvcmas_bench.modeling as modeling

    def no_model(*a, **kw):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(modeling, "load_model", no_model)
    capsys.readouterr()
    rc = run_cli(["ablate", *extra, "--model", "unused", "-o", str(tmp_path / "a")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "a").exists()
