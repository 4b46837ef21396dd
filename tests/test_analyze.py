"""analyze: effective rank against synthetic matrices of known rank and spectrum (closed forms),
`analyze rank` and `analyze chain` end to end on a tiny random-weight model (tables, figures and the
plotted series), and `coverage` as `analyze coverage`."""

from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

from kvcmas_bench.analysis.chain import chain_figure
from kvcmas_bench.analysis.rank import Spectra, per_layer, rank_figure, reconstruction, summary
from kvcmas_bench.ops.lowrank import effective_rank
from kvcmas_bench.ops.spectrum import effective_ranks, truncation_errors_from

from .conftest import run_cli


def _with_spectrum(s: list[float], rows: int = 40, cols: int = 24, seed: int = 0) -> torch.Tensor:
    """``U diag(s) V^T`` with random orthonormal U, V: a matrix with exactly the singular values s."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ v.T


def test_effective_rank_of_matrices_of_known_rank():
    g = torch.Generator().manual_seed(1)
    layers = [
        torch.randn(50, r, generator=g, dtype=torch.float64) @ torch.randn(r, 30, generator=g, dtype=torch.float64)
        for r in (1, 3, 7, 12)
    ]
    z = torch.stack(layers)
    # all the energy: the exact rank of every layer
    assert effective_ranks(z, energy=1.0).tolist() == [1, 3, 7, 12]
    # a rank-r matrix never needs more than r components, whatever the threshold
    for e in (0.5, 0.9, 0.99):
        assert all(a <= r for a, r in zip(effective_ranks(z, e).tolist(), (1, 3, 7, 12)))
    assert effective_rank(z, 1.0) == pytest.approx((1 + 3 + 7 + 12) / 4)  # the mean over layers
    assert effective_ranks(torch.zeros(2, 5, 4)).tolist() == [0, 0]  # no energy: rank 0


def test_energy_threshold_is_a_parameter_closed_form():
    # squared singular values 0.5, 0.3, 0.15, 0.05 of the total energy
    s = [math.sqrt(x) for x in (0.5, 0.3, 0.15, 0.05)]
    z = _with_spectrum(s)[None]
    for energy, rank in ((0.4, 1), (0.5, 1), (0.6, 2), (0.8, 2), (0.9, 3), (0.95, 3), (0.96, 4), (1.0, 4)):
        assert int(effective_ranks(z, energy)[0]) == rank, energy
    # relative error of the best rank-r approximation: sqrt(energy beyond r)
    errs = truncation_errors_from(torch.tensor(s, dtype=torch.float64)[None], [1, 2, 3, 4, 8])[0].tolist()
    assert errs == pytest.approx([math.sqrt(0.5), math.sqrt(0.2), math.sqrt(0.05), 0.0, 0.0], abs=1e-12)
    with pytest.raises(ValueError):
        effective_ranks(z, 0.0)


def test_spectra_skip_layers_without_deviation_and_summarize():
    base = torch.stack([_with_spectrum([3.0, 2.0, 2.0], seed=i).float() for i in range(3)])
    delta = torch.stack(
        [torch.zeros(40, 24), _with_spectrum([1.0], seed=5).float(), _with_spectrum([2.0, 2.0], seed=6).float()]
    )
    sp = Spectra(0.9, (1, 2, 4))
    sp.add("base", "V", base, workload="w")
    sp.add("ph_delta", "V", delta, ref=base, workload="w")
    df = sp.frame()
    layers = per_layer(df).set_index(["kind", "layer"])
    assert math.isnan(layers.loc[("ph_delta", 0), "effective_rank"])  # layer 0: no deviation
    assert layers.loc[("ph_delta", 1), "effective_rank"] == 1 and layers.loc[("ph_delta", 2), "effective_rank"] == 2
    assert layers.loc[("base", 0), "effective_rank"] == 3  # 9 + 4 = 13 of 17 < 90%: three components
    summ = summary(df, (1, 2, 4)).set_index("kind")
    assert summ.loc["ph_delta", "effective_rank"] == 1.5  # mean over the layers with a deviation
    rec = reconstruction(df, (1, 2, 4)).set_index(["kind", "rank"])
    assert rec.loc[("ph_delta", 1), "rel_error"] == pytest.approx((0.0 + math.sqrt(0.5)) / 2, abs=1e-6)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


COMMON = ["--device", "cpu", "--max-new-tokens", "5", "--final-max-new-tokens", "2"]


def test_analyze_rank_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "rank"
    cmd = ["analyze", "rank", "--model", tiny_model_dir, "--limit", "3", "--workloads", "mmlu,gsm8k", *COMMON]
    assert run_cli([*cmd, "--energy", "0.8", "--ranks", "1,4,16", "-o", str(out)]) == 0
    summ = pd.read_csv(out / "rank_summary.csv")
    assert set(zip(summ["workload"], summ["kind"], summ["part"])) == {
        (w, k, p) for w in ("mmlu", "gsm8k") for k in ("base", "ph_delta", "pf_delta") for p in ("K", "V")
    }
    assert (summ["effective_rank"] >= 1).all() and (summ["effective_rank"] <= summ["dim"]).all()
    assert {"err_r1", "err_r4", "err_r16"} <= set(summ.columns)
    layers = pd.read_csv(out / "rank_per_layer.csv")
    recon = pd.read_csv(out / "rank_recon.csv")
    assert sorted(set(recon["rank"])) == [1, 4, 16]
    meta = json.loads((out / "rank.json").read_text())
    assert meta["energy"] == 0.8 and len(meta["samples"]["mmlu"]) == 3
    assert (out / "figures" / "rank_mmlu.png").exists() and (out / "figures" / "rank_gsm8k.svg").exists()
    # the plotted series are the table's
    w = layers[layers["workload"] == "mmlu"]
    fig, (ax, bx) = rank_figure(w, recon[recon["workload"] == "mmlu"], "t", 0.8)
    lines = {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}
    assert {f"rank:{k}:{p}" for k in ("base", "ph_delta", "pf_delta") for p in ("K", "V")} <= set(lines)
    g = w[(w["kind"] == "pf_delta") & (w["part"] == "V")]
    assert list(lines["rank:pf_delta:V"].get_ydata()) == pytest.approx(list(g["effective_rank"]), nan_ok=True)
    curve = {ln.get_gid(): ln for ln in bx.get_lines()}["recon:ph_delta:K"]
    r = recon[(recon["workload"] == "mmlu") & (recon["kind"] == "ph_delta") & (recon["part"] == "K")]
    assert list(curve.get_xdata()) == [1, 4, 16] and list(curve.get_ydata()) == pytest.approx(list(r["rel_error"]))
    assert list(r["rel_error"]) == sorted(r["rel_error"], reverse=True)  # error falls as the rank grows
    plt.close(fig)


def test_analyze_chain_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "chain"
    cmd = ["analyze", "chain", "--model", tiny_model_dir, "--limit", "3", "--tau", "1", *COMMON, "-o", str(out)]
    assert run_cli(cmd) == 0
    agents = pd.read_csv(out / "chain_per_agent.csv")
    layers = pd.read_csv(out / "chain_per_layer.csv")
    assert set(agents["method"]) == {"kvcmas", "kvcmas-nonchained"} and sorted(set(agents["step"])) == [0, 1, 2, 3]
    ch = agents[agents["method"] == "kvcmas"].set_index("step")
    nc = agents[agents["method"] == "kvcmas-nonchained"].set_index("step")
    # chained: the first agent prefills densely, its cache equals the full dense prefill's up to
    # float rounding (segment-by-segment vs one forward); non-chained corrects it too
    assert ch.loc[0, "kv_rel_error"] < 1e-6 and ch.loc[0, "corrected"] == 0
    assert nc.loc[0, "corrected"] > 0 and nc.loc[0, "kv_rel_error"] > 0
    assert sorted(set(layers["layer"])) == [0, 1]
    # both runs are ordinary run directories over the same samples
    ids = [
        [json.loads(x)["sample_id"] for x in (out / "mmlu" / m / "samples.jsonl").read_text().splitlines()]
        for m in ("kvcmas", "kvcmas-nonchained")
    ]
    assert ids[0] == ids[1] and len(ids[0]) == 3
    assert (out / "figures" / "chain_mmlu.png").exists()
    fig, (ax, bx) = chain_figure(agents, layers, "t")
    lines = {ln.get_gid(): ln for ln in bx.get_lines() if ln.get_gid()}
    assert list(lines["agent:kvcmas:all"].get_ydata()) == pytest.approx(list(ch["kv_rel_error"]))
    assert list(lines["agent:kvcmas-nonchained:all"].get_xdata()) == ["A0", "A1", "A2", "A3"]
    per_layer_lines = {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}
    nl = layers[layers["method"] == "kvcmas-nonchained"]
    assert list(per_layer_lines["layer:kvcmas-nonchained:all"].get_ydata()) == pytest.approx(list(nl["kv_rel_error"]))
    plt.close(fig)
    assert run_cli(cmd) == 0  # resumes: nothing left to run


def test_coverage_is_also_analyze_coverage(tiny_model_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["--model", tiny_model_dir, "--limit", "2", "--device", "cpu", "--max-new-tokens", "3", "--rho", "0.8"]
    assert run_cli(["analyze", "coverage", *base, "-o", str(a)]) == 0
    assert run_cli(["coverage", *base, "-o", str(b)]) == 0
    assert (a / "coverage.csv").read_text() == (b / "coverage.csv").read_text()
