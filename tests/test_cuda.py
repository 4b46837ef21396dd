"""The engine, every method and the CLI on a CUDA device, against dense references on that device
and against the same runs on the CPU (which the rest of the suite proves against dense prefill).

Skipped where torch sees no CUDA device (CI, this project's development machine); run with
``scripts/gpu_inprocess_check.sh`` on a GPU machine. float32 throughout except where a test says
bfloat16; TF32 matmuls are off (torch's default), so CUDA and CPU agree to float32 rounding.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kvcmas_bench.calibration import Recorder
from kvcmas_bench.engine import Engine
from kvcmas_bench.methods import METHODS, get_method
from kvcmas_bench.ops.kvmath import relative_error
from kvcmas_bench.segments import Request, Segment

from .conftest import LLAMA3_ROPE, rand_ids, run_cli, smooth_tiny_model, tiny_model
from .test_engine import PIECES, segmentwise_logits
from .test_paper_semantics import NODES, chain, chain_request

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def pair():
    """The same tiny llama on the CPU and on the GPU."""
    cpu = tiny_model("llama", rope=LLAMA3_ROPE, seed=3)
    return Engine(cpu), Engine(copy.deepcopy(cpu).to(CUDA))


def test_segmentwise_prefill_on_cuda_matches_the_whole_forward(pair):
    _, eng = pair
    ids = [t for p in PIECES for t in p]
    ref = eng.model(torch.tensor([ids], device=CUDA)).logits[0]
    got, cache = segmentwise_logits(eng, PIECES)
    assert got.device.type == "cuda" and cache.k.device.type == "cuda"
    assert (got - ref).abs().max().item() < 1e-4


def test_nonshared_and_fullshared_on_cuda_equal_the_cpu_runs(pair):
    cpu, gpu = pair
    q = rand_ids(20, 5)
    sys_a, tail = rand_ids(6, 6), rand_ids(4, 7)
    ra = Request("A", [Segment("PF", sys_a), Segment("PH", q, slot="q"), Segment("PF", tail)], 4)
    rb = Request("B", [Segment("PF", sys_a), Segment("PH", q, slot="q", source="A"), Segment("PF", tail)], 4)
    outs = {}
    for eng in (cpu, gpu):
        a = eng.run(ra, get_method("nonshared"))
        b = eng.run(rb, get_method("fullshared"), sources={"q": a.materialized["q"]}, fidelity=True)
        outs[eng.device.type] = (a, b)
    (ac, bc), (ag, bg) = outs["cpu"], outs["cuda"]
    assert ag.output_ids == ac.output_ids and bg.output_ids == bc.output_ids
    assert bg.output_ids == ag.output_ids  # identical prefix: FullShared is exact
    assert bg.segments[1].kv_rel_error < 1e-5
    kc, kg = ac.materialized["q"], ag.materialized["q"]
    assert kg.k.device.type == "cuda"
    assert relative_error(kg.k.cpu(), kc.k) < 1e-5 and relative_error(kg.v.cpu(), kc.v) < 1e-5


def test_device_peak_counter_is_read_and_resets(pair):
    from kvcmas_bench.memory import reset_peaks

    _, eng = pair
    reset_peaks(eng.device)
    base = eng.device_peak()
    big = torch.empty(64 << 20, dtype=torch.uint8, device=CUDA)  # 64 MiB
    assert eng.device_peak() >= base + (64 << 20)
    del big
    reset_peaks(eng.device)
    assert eng.device_peak() < base + (64 << 20)


def _options(name: str) -> dict:
    if name in ("kvcmas", "kvcmas-nonchained"):
        return {"anchors": 3, "rank": 4, "tau": 1.0}
    if name == "kvcomm":
        return {"anchors": 3, "tau": 1.0}
    if name == "droidspeak":  # at its default 0.9 no layer of the 3 is recomputed: FullShared
        return {"rho": 0.5}
    return {}


#: the status of a shared segment served by each sharing method's own path (NonShared has none)
OWN_STATUS = {
    **dict.fromkeys(["graphflow", "kvcmas", "kvcmas-nonchained", "kvcomm"], "corrected"),
    **dict.fromkeys(["cacheblend", "droidspeak", "relaycaching"], "recomputed"),
    "fullshared": "reused",
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_on_cuda_follows_its_cpu_run(pair, name):
    """Three samples through the 4-agent chain with fidelity: the same first tokens and statuses on
    both devices, and the same KV error against a dense prefill to 1e-3 relative (plus 1e-5 absolute:
    float32 rounding of the exact segments' errors, 1e-7 on one device and 6e-7 on the other)."""
    runs = {}
    for eng in pair:
        m = get_method(name, **_options(name))
        rec = Recorder(with_reference=True)  # every method calibrates (a no-op for most)
        chain(eng, rec, rand_ids(12, 60))
        m.calibrate(rec.observations, eng.n_layers)
        out = []
        for seed in (61, 62, 63):
            out += chain(eng, m, rand_ids(12, seed), fidelity=True)
        runs[eng.device.type] = out
    if name in OWN_STATUS:  # the method's own path ran, not only dense fallbacks
        assert OWN_STATUS[name] in [r.segments[1].status for r in runs["cuda"]]
    for c, g in zip(runs["cpu"], runs["cuda"]):
        assert g.first_token_id == c.first_token_id
        assert [s.status for s in g.segments] == [s.status for s in c.segments]
        ec, eg = c.segments[1].kv_rel_error, g.segments[1].kv_rel_error
        assert abs(eg - ec) <= 1e-3 * ec + 1e-5, (name, ec, eg)


def test_kvcmas_exact_anchor_on_cuda_reproduces_dense(pair):
    """V = 1, full rank: the correction is exact, so every later agent's first token is the dense one."""
    _, eng = pair
    m = get_method("kvcmas", anchors=1, rank=None)
    q = rand_ids(12, 70)
    chain(eng, m, q)  # stores the anchor
    res = chain(eng, m, q, fidelity=True)
    assert [r.segments[1].status for r in res[1:]] == ["corrected"] * (len(NODES) - 1)
    for node, r in zip(NODES, res):
        dense = eng.run(chain_request(node, q), get_method("nonshared"))
        assert r.first_token_id == dense.first_token_id
        assert r.segments[1].kv_rel_error < 1e-4


def test_subspace_factorization_on_cuda_equals_the_cpu_one_and_the_exact_truncation():
    """The default factorization on a GPU (svd=auto: subspace iteration) against the same call on the
    CPU (same seeded start) and against the exact truncated SVD's reconstruction error."""
    from kvcmas_bench.ops.lowrank import factorize, truncated_svd

    g = torch.Generator().manual_seed(4)
    z = torch.randn(3, 300, 96, generator=g) @ torch.randn(3, 96, 96, generator=g) * torch.linspace(0.1, 3.0, 96)
    a_gpu, b_gpu = factorize(z.to(CUDA), 16)
    assert a_gpu.device.type == "cuda"
    a_cpu, b_cpu = factorize(z, 16, "subspace")
    rec_gpu, rec_cpu = torch.bmm(a_gpu, b_gpu).cpu(), torch.bmm(a_cpu, b_cpu)
    assert relative_error(rec_gpu, rec_cpu) < 1e-4
    exact = relative_error(torch.bmm(*truncated_svd(z, 16)), z)
    assert abs(relative_error(rec_gpu, z) / exact - 1) < 1e-4


def test_batched_bfloat16_gram_factorization_on_cuda_equals_the_cpu_one():
    """The anchor insertion's path on a GPU: the bfloat16 Gram matrix by one tensor-core GEMM with
    float32 output equals the CPU's float32 Gram of the rounded rows, and three stacks factorized in
    one subspace iteration equal each alone and the CPU's factors."""
    from kvcmas_bench.ops.lowrank import gram_matrices, subspace_factors, truncated_svd_subspace

    g = torch.Generator().manual_seed(5)
    zs = [torch.randn(3, 300, 96, generator=g) @ torch.randn(3, 96, 96, generator=g) for _ in range(3)]
    gpu_gram = gram_matrices(zs[0].to(CUDA), torch.bfloat16)
    assert gpu_gram.dtype == torch.float32
    assert torch.allclose(gpu_gram.cpu(), gram_matrices(zs[0], torch.bfloat16), rtol=1e-4, atol=1e-3)
    together = subspace_factors([z.to(CUDA) for z in zs], 16, gram_dtype=torch.bfloat16)
    for z, (a, b) in zip(zs, together):
        a1, b1 = truncated_svd_subspace(z.to(CUDA), 16, gram_dtype=torch.bfloat16)
        assert relative_error(torch.bmm(a, b), torch.bmm(a1, b1)) < 1e-5
        ac, bc = truncated_svd_subspace(z, 16, gram_dtype=torch.bfloat16)
        assert relative_error(torch.bmm(a, b).cpu(), torch.bmm(ac, bc)) < 1e-4


def test_bfloat16_kvcmas_chain_runs_on_cuda():
    """bfloat16 weights (the GPU default of serving): anchors, gate and correction keep their dtypes
    consistent; the KV error stays small next to FullShared's."""
    eng = Engine(smooth_tiny_model().to(CUDA, torch.bfloat16))
    errs = {}
    for name in ("fullshared", "kvcmas"):
        m = get_method(name, **_options(name))
        out = []
        for seed in (81, 82, 83, 84):
            out += chain(eng, m, rand_ids(12, seed), fidelity=True)
        errs[name] = sum(r.segments[1].kv_rel_error for r in out[-3:]) / 3
        assert out[-1].materialized["q"].k.dtype == torch.bfloat16
        if name == "kvcmas":
            assert "corrected" in [r.segments[1].status for r in out[-3:]]
    assert 0 < errs["kvcmas"] < errs["fullshared"], errs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cli_run_on_cuda_reports_device_memory(tiny_model_dir, tmp_path, dtype):
    out = tmp_path / dtype
    args = ["run", "--method", "kvcmas", "--model", tiny_model_dir, "--device", "cuda", "--dtype", dtype]
    args += ["--limit", "2", "--max-new-tokens", "4", "--final-max-new-tokens", "2", "--fidelity", "-o", str(out)]
    assert run_cli(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["device"].startswith("cuda") and config["hardware"]["gpu"]
    assert summary["n"] == 2
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert recs and all(r["device_peak_bytes"] > 0 and r["peak_mem_bytes"] == r["device_peak_bytes"] for r in recs)


def test_cli_serve_sweep_on_cuda(tiny_model_dir, tmp_path):
    out = tmp_path / "sweep"
    args = ["serve-sweep", "--model", tiny_model_dir, "--device", "cuda", "--method", "nonshared,kvcmas"]
    args += ["--qps", "0,4", "--shared-tokens", "64", "--trajectories", "3", "--calib-trajectories", "1"]
    args += ["--output-tokens", "2", "-o", str(out)]
    assert run_cli(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"].startswith("cuda")
    assert {r["method"] for r in summary["rows"]} == {"nonshared", "kvcmas"}
