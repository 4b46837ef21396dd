"""Numbers a reviewer can trust: the correction path against hand-written references, the reuse
ratio and fidelity definitions on hand-built cases, the TTFT boundary, per-node consumers, method
accounting, and resume with persisted method state."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvcmas_bench.calibration import Recorder
from kvcmas_bench.engine import Engine
from kvcmas_bench.errors import OptionError
from kvcmas_bench.methods import get_method, resolve_method
from kvcmas_bench.methods.anchors import AnchorPool
from kvcmas_bench.ops.kvmath import shift_keys
from kvcmas_bench.results.request import RequestRecord
from kvcmas_bench.results.summary import accounting, fidelity, records_frame, reuse_ratio
from kvcmas_bench.segments import Request, Segment
from kvcmas_bench.workloads import get_workload

from .conftest import interrupt_on_call, rand_ids, run_cli, smooth_tiny_model

PF_A, PF_B, PF_C = rand_ids(6, 10), rand_ids(9, 11), rand_ids(7, 15)
TAIL = rand_ids(4, 13)


def req(agent: str, pf: list[int], shared: dict[str, list[int]], node: str | None = None) -> Request:
    segs = [Segment("PF", pf)]
    for slot, ids in shared.items():
        segs += [Segment("PH", ids, slot=slot), Segment("PF", rand_ids(2, len(slot)))]
    segs[-1] = Segment("PF", TAIL)
    return Request(agent, segs, 2, node=node)


@pytest.fixture(scope="module")
def smooth():
    """A tiny random Llama with small weights (std 0.05): its caches vary smoothly with the
    content, so corrections learned on some questions carry over to others, as on a real model."""
    return Engine(smooth_tiny_model())


# ---- the gate -----------------------------------------------------------------------------------
def _gate_pool(ref_v: torch.Tensor, offsets: list[float], rank=None) -> AnchorPool:
    """Anchors whose base values sit at Frobenius distance ``offsets[i]`` from ``ref_v``."""
    pool = AnchorPool(10)
    g = torch.Generator().manual_seed(7)
    for i, off in enumerate(offsets):
        u = torch.randn(ref_v.shape, generator=g)
        base = ref_v + off * u / u.norm()
        pool.add(f"src{i}", ("src", i), base, base, "B", torch.zeros_like(base), torch.zeros_like(base), rank)
    return pool


def _entropy_by_hand(ref_v: torch.Tensor, pool: AnchorPool, k: int) -> float:
    d = []
    for a in pool.anchors:
        f = a.entries["B"].base_v
        rec = f.a[:, :k] if f.b is None else torch.matmul(f.a[:, :k], f.b)
        d.append(math.sqrt(float(((ref_v[:, :k] - rec) ** 2).sum())))
    z = [math.exp(-x) for x in d]
    p = [x / sum(z) for x in z]
    return -sum(q * math.log2(q) for q in p if q > 0) / math.log2(len(p))


@pytest.mark.parametrize("rank", [None, 64])
def test_gate_accepts_a_peaked_pool_and_rejects_a_near_tie_at_tau_03(rank):
    m = get_method("kvcmas", tau=0.3, rank=rank)
    ref_v = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(1))
    peaked = _gate_pool(ref_v, [0.1, 6.0, 9.0], rank)
    details: dict = {}
    assert m.gate(peaked, "B", ref_v, 10, details) is not None
    assert details["gate"] == "accepted" and details["entropy"] < 0.1
    assert details["entropy"] == pytest.approx(_entropy_by_hand(ref_v, peaked, 10), abs=1e-5)
    tie = _gate_pool(ref_v, [2.0, 2.4], rank)  # p = sigmoid(0.4): entropy 0.97
    details = {}
    assert m.gate(tie, "B", ref_v, 10, details) is None
    h = _entropy_by_hand(ref_v, tie, 10)
    assert details["gate"] == "rejected" and details["entropy"] == pytest.approx(h, abs=1e-5)
    p = 1 / (1 + math.exp(-0.4))
    assert h == pytest.approx(-(p * math.log2(p) + (1 - p) * math.log2(1 - p)), abs=1e-4)
    m.tau = 0.99  # the threshold, not the pool, decides: the same near tie passes a looser gate
    assert m.gate(tie, "B", ref_v, 10) is not None


# ---- token-wise weights and the weighted apply, against a straightforward reference --------------
def _expected_correction(ref, anchors, consumer, start, inv_freq, heads, k, lowrank):
    """align(C_ref) + sum_v w_v Delta_v with every anchor reconstructed: distances per token
    (RMS over layers and dims for low-rank anchors, mean absolute for full ones), softmax over
    anchors, weighted sum of the reconstructed deltas on the first k rows; keys in canonical
    coordinates, rotated to ``start`` at the end."""
    L, H, S, hd = ref.k.shape

    def rows(x):  # [L, H, S, hd] -> [L, S, H*hd]
        return x.permute(0, 2, 1, 3).reshape(L, x.shape[2], H * hd)

    def recon(f, n):
        return f.a[:, :n].float() if f.b is None else torch.matmul(f.a[:, :n].float(), f.b.float())

    out = {}
    canon_k = shift_keys(ref.k, -ref.start, inv_freq)
    for part, x, bi, di in (("k", rows(canon_k), 0, 0), ("v", rows(ref.v), 1, 1)):
        bases = [recon(a.factor(("base_k", "base_v")[bi], consumer), k) for a in anchors]
        deltas = [recon(a.factor(("delta_k", "delta_v")[di], consumer), k) for a in anchors]
        xk = x[:, :k].float()
        if lowrank:
            dist = torch.stack([((xk - b) ** 2).mean(dim=(0, 2)).sqrt() for b in bases])
        else:
            dist = torch.stack([(xk - b).abs().mean(dim=(0, 2)) for b in bases])
        w = torch.softmax(-dist, dim=0)
        y = x.float().clone()
        for v in range(len(anchors)):
            y[:, :k] += w[v][None, :, None] * deltas[v]
        out[part] = y.reshape(L, S, H, hd).permute(0, 2, 1, 3)
    return shift_keys(out["k"], start, inv_freq), out["v"]


@pytest.mark.parametrize("rank", [4, None], ids=["low-rank", "full"])
@pytest.mark.parametrize("short", [0, 3], ids=["k=S", "k<S"])
def test_correction_equals_the_hand_written_weighted_sum(engine, rank, short):
    q = rand_ids(15, 12)
    ra, rb = req("A", PF_A, {"q": q}), req("B", PF_B, {"q": q})
    a = engine.run(ra, get_method("nonshared"))
    src = a.materialized["q"]
    m = get_method("kvcmas", tau=1.0, rank=rank)
    S = len(q)
    canon = torch.stack([shift_keys(src.k, -src.start, engine.inv_freq), src.v])
    L, H, _, hd = src.k.shape
    g = torch.Generator().manual_seed(5)
    pool = AnchorPool(10)
    n = S - short
    rows = canon.permute(0, 1, 3, 2, 4).reshape(2, L, S, H * hd)[:, :, :n]  # [K/V, L, n, D]
    for i, scale in enumerate((0.05, 0.2, 0.6)):  # anchors at different distances from the source
        base = rows + scale * torch.randn(rows.shape, generator=g)
        dk, dv = torch.randn(L, n, H * hd, generator=g), torch.randn(L, n, H * hd, generator=g)
        pool.add(f"src{i}", ("src", i), base[0], base[1], "B", dk, dv, rank)
    m.pools["q"] = pool
    b = engine.run(rb, m, sources={"q": src})
    got = b.materialized["q"]
    assert b.segments[1].status == "corrected" and b.segments[1].details["compare_tokens"] == S - short
    start = got.start
    ek, ev = _expected_correction(src, pool.anchors, "B", start, engine.inv_freq, H, S - short, rank is not None)
    assert torch.allclose(got.k, ek, atol=2e-4, rtol=1e-4)
    assert torch.allclose(got.v, ev, atol=2e-4, rtol=1e-4)
    if short:  # rows beyond the covered prefix are the aligned source
        aligned = src.aligned(start, engine.inv_freq)
        assert torch.allclose(got.v[:, :, S - short :], aligned.v[:, :, S - short :])
        assert torch.allclose(got.k[:, :, S - short :], aligned.k[:, :, S - short :], atol=1e-5)


# ---- a chain of three agents, every edge with exact anchors ------------------------------------
def _chain_pass(engine, m, q, fidelity=False):
    ra, rb, rc = req("A", PF_A, {"q": q}), req("B", PF_B, {"q": q}), req("C", PF_C, {"q": q})
    a = engine.run(ra, m, fidelity=fidelity)
    b = engine.run(rb, m, sources={"q": a.materialized["q"]}, fidelity=fidelity)
    c = engine.run(rc, m, sources={"q": b.materialized["q"]}, fidelity=fidelity)
    return a, b, c


def test_three_agent_chain_with_exact_anchors_reproduces_every_dense_cache(engine):
    """A filling pass gives each consumer (B, C) an exact full-rank entry in the anchor of this
    question; with V = 1 the gate is bypassed (paper C.3), so the second pass corrects B from A and
    C from B's *corrected* cache, and all three equal dense prefill."""
    q = rand_ids(15, 40)
    m = get_method("kvcmas", anchors=1, rank=64)
    _chain_pass(engine, m, q)
    (anchor,) = m.pools["q"].anchors
    assert sorted(anchor.entries) == ["B", "C"]  # one instance, one entry per consumer
    a, b, c = _chain_pass(engine, m, q, fidelity=True)
    assert [r.segments[1].status for r in (a, b, c)] == ["exact", "corrected", "corrected"]
    for r in (a, b, c):
        assert r.segments[1].kv_rel_error < 1e-5
    assert c.segments[1].source_agent == "B"


def test_three_agent_chain_error_falls_with_the_rank(engine):
    q = rand_ids(15, 40)
    errs = {}
    for rank in (1, 2, 4, 8, 15):
        m = get_method("kvcmas", anchors=1, rank=rank)
        _chain_pass(engine, m, q)
        _, b, c = _chain_pass(engine, m, q, fidelity=True)
        assert b.segments[1].status == c.segments[1].status == "corrected"
        errs[rank] = (b.segments[1].kv_rel_error, c.segments[1].kv_rel_error)
    ranks = sorted(errs)
    for lo, hi in zip(ranks, ranks[1:]):
        assert errs[hi][0] < errs[lo][0] and errs[hi][1] < errs[lo][1], errs
    assert errs[15][0] < 1e-5 and errs[15][1] < 1e-5  # full rank (S = 15 < D = 32) is exact
    assert errs[1][1] > 1e-2


# ---- corrections learned on other questions -----------------------------------------------------
def test_kvcmas_corrects_with_anchors_from_other_questions(smooth):
    m = get_method("kvcmas", anchors=4, tau=1.0, rank=8)
    for seed in (21, 22, 23):  # three different questions fill the pool
        q = rand_ids(15, seed)
        a = smooth.run(req("A", PF_A, {"q": q}), m)
        smooth.run(req("B", PF_B, {"q": q}), m, sources={"q": a.materialized["q"]})
    q = rand_ids(15, 30)  # the evaluated question is none of them
    a = smooth.run(req("A", PF_A, {"q": q}), m)
    got = smooth.run(req("B", PF_B, {"q": q}), m, sources={"q": a.materialized["q"]}, fidelity=True)
    full = smooth.run(
        req("B", PF_B, {"q": q}), get_method("fullshared"), sources={"q": a.materialized["q"]}, fidelity=True
    )
    assert got.segments[1].status == "corrected"
    assert got.segments[1].kv_rel_error < 0.7 * full.segments[1].kv_rel_error


def test_graphflow_calibrated_on_disjoint_questions(smooth):
    rec = Recorder(with_reference=True)
    for seed in range(21, 29):
        q = rand_ids(15, seed)
        a = smooth.run(req("A", PF_A, {"q": q}), rec)
        smooth.run(req("B", PF_B, {"q": q}), rec, sources={"q": a.materialized["q"]})
    gf = get_method("graphflow")
    gf.calibrate(rec.observations, smooth.n_layers)
    q = rand_ids(15, 30)
    plain = get_method("graphflow")  # no calibration: the plain reference
    # the first agent's prefix is short, so its mean correction is small; B's is clear
    for agent, pf, margin in (("B", PF_B, 0.85), ("A", PF_A, 1.0)):
        got = smooth.run(req(agent, pf, {"q": q}), gf, fidelity=True)
        ref = smooth.run(req(agent, pf, {"q": q}), plain, fidelity=True)
        assert got.segments[1].status == "corrected" and ref.segments[1].status == "uncalibrated"
        assert got.segments[1].kv_rel_error < margin * ref.segments[1].kv_rel_error, agent


# ---- the reuse ratio on a hand-built case --------------------------------------------------------
def _rho(results, layers) -> float:
    recs = [
        RequestRecord(
            r.agent,
            0.0,
            0.0,
            eligible_tokens=r.eligible_tokens,
            reused_tokens=r.reused_tokens,
            recomputed_token_layers=r.recomputed_token_layers,
            layers=layers,
        )
        for r in results
    ]
    return reuse_ratio(records_frame(recs))


def _three(engine, m, q, r, chained: bool):
    ra, rb, rc = (req(x, pf, {"q": q, "r": r}) for x, pf in (("A", PF_A), ("B", PF_B), ("C", PF_C)))
    a = engine.run(ra, m)
    src_b = {k: a.materialized[k] for k in ("q", "r")} if chained else {}
    b = engine.run(rb, m, sources=src_b)
    src_c = {k: b.materialized[k] for k in ("q", "r")} if chained else {}
    c = engine.run(rc, m, sources=src_c)
    return a, b, c


def _seed_anchor(m, slot: str, ids: list[int], consumers: list[str], L=3, D=32):
    z = torch.zeros(L, len(ids), D)
    pool = m.pools.setdefault(slot, AnchorPool(m.anchors))
    for c in consumers:
        pool.add(f"seed-{slot}", ("seed", slot), z, z, c, z, z, m.rank)


def test_reuse_ratio_of_a_hand_built_three_agent_case(engine):
    """Agents A -> B -> C, each prompt holding shared segments q (15 tokens) and r (7 tokens)."""
    q, r = rand_ids(15, 50), rand_ids(7, 51)
    L = engine.n_layers
    # chained, no fallback: FullShared reuses B's and C's segments; A has no source, not eligible
    res = _three(engine, get_method("fullshared"), q, r, chained=True)
    assert [x.eligible_tokens for x in res] == [0, 22, 22] and _rho(res, L) == 1.0
    # chained with fallbacks: only B's q has an anchor (V = 1 bypasses the gate) -> 15 of 44
    m = get_method("kvcmas", anchors=1, rank=None)
    _seed_anchor(m, "q", q, ["B"])
    res = _three(engine, m, q, r, chained=True)
    assert [[s.status for s in x.segments if s.kind == "PH"] for x in res] == [
        ["exact", "exact"],
        ["corrected", "exact"],
        ["exact", "exact"],
    ]
    assert [x.eligible_tokens for x in res] == [0, 22, 22] and _rho(res, L) == pytest.approx(15 / 44)
    # non-chained: every shared segment is eligible, the first agent's too; only A's q accepted
    m = get_method("kvcmas-nonchained", anchors=1, rank=None)
    _seed_anchor(m, "q", q, ["A"])
    res = _three(engine, m, q, r, chained=False)
    assert [x.eligible_tokens for x in res] == [22, 22, 22] and _rho(res, L) == pytest.approx(15 / 66)
    # non-chained without fallbacks: one anchor per slot serving all three consumers -> 66 of 66
    m = get_method("kvcmas-nonchained", anchors=1, rank=None)
    _seed_anchor(m, "q", q, ["A", "B", "C"])
    _seed_anchor(m, "r", r, ["A", "B", "C"])
    res = _three(engine, m, q, r, chained=False)
    # the first request prefills the context-free references of q (15) and r (7), the others reuse them
    assert _rho(res, L) == 1.0 and [x.reference_tokens for x in res] == [22, 0, 0]


def test_fidelity_counts_every_shared_segment_and_per_layer():
    from kvcmas_bench.results.request import SegmentRecord

    def rec(step, errs, top1):
        segs = [SegmentRecord("PF", 3)] + [
            SegmentRecord("PH", 5, status=st, kv_rel_error=e, kv_rel_error_per_layer=[e / 2, e, 3 * e / 2])
            for st, e in errs
        ]
        return RequestRecord(
            f"a{step}", 0.1, 0.2, step=step, node=f"n{step}", segments=segs, top1_agree=top1, first_token_kl=0.0
        )

    recs = [rec(0, [("corrected", 0.4)], True), rec(1, [("corrected", 0.2), ("exact", 0.0)], False)]
    f = fidelity(recs)
    assert f["kv_rel_error"] == pytest.approx((0.4 + 0.2 + 0.0) / 3)  # the first agent's error counts
    assert [a["kv_rel_error"] for a in f["per_agent"]] == pytest.approx([0.4, 0.1])
    assert f["per_layer"] == pytest.approx([0.1, 0.2, 0.3])
    assert f["by_status"] == pytest.approx({"corrected": 0.3, "exact": 0.0})
    assert f["top1_agree"] == 0.5 and f["segments"] == 3


def test_summary_figures_carry_their_uncertainty_under_one_name_each():
    from kvcmas_bench.results.request import SegmentRecord
    from kvcmas_bench.results.summary import summarize

    def rec(sid, step, ttft, err, top1):
        seg = SegmentRecord("PH", 4, status="exact" if err == 0 else "reused", kv_rel_error=err)
        return RequestRecord(f"a{step}", ttft, 2 * ttft, sample_id=sid, step=step, node=f"n{step}", layers=2,
                             segments=[seg], top1_agree=top1, first_token_kl=0.1, method_state_bytes=100 * step,
                             peak_mem_bytes=7, kv_state_bytes=9)  # fmt: skip

    samples = [{"sample_id": f"s{i}", "correct": c, "latency_s": 1.0 + i} for i, c in enumerate([1, 1, 0, 1])]
    reqs = [
        rec(f"s{i}", step, 0.1 * (i + 1), 0.0 if step == 0 else 0.2, step == 0) for i in range(4) for step in (0, 1)
    ]
    s = summarize(samples, reqs, {"method": "m"})
    # accuracy 3/4: SE sqrt(0.75 * 0.25 / 4) = 0.2165; Wilson 95% roots of (0.75 - x)^2 = z^2 x (1 - x) / 4
    assert s["accuracy"] == 0.75 and s["accuracy_se"] == pytest.approx(0.216506, abs=1e-6)
    assert (s["accuracy_ci_low"], s["accuracy_ci_high"]) == pytest.approx((0.300642, 0.954413), abs=1e-6)
    assert s["latency_mean_s"] == pytest.approx(2.5) and s["latency_p50_s"] == pytest.approx(2.5)
    ttfts = [0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4]
    assert s["ttft_mean_s"] == pytest.approx(0.25) and s["ttft_p50_s"] == pytest.approx(0.25)
    assert s["ttft_p90_s"] == pytest.approx(0.4)  # linear: position 0.9 * 7 = 6.3 between 0.4 and 0.4
    assert s["e2e_mean_s"] == pytest.approx(2 * sum(ttfts) / 8)
    assert s["method_state_peak_bytes"] == 100 and s["peak_mem_bytes"] == 7 and s["kv_state_peak_bytes"] == 9
    f = s["fidelity"]
    assert f["kv_rel_error"] == pytest.approx(0.1)  # (4 exact segments at 0 + 4 at 0.2) / 8
    assert f["top1_agree"] == 0.5 and f["top1_agree_se"] == pytest.approx((0.25 / 8) ** 0.5)
    assert f["first_token_kl"] == pytest.approx(0.1) and f["segments"] == 8
    for old in ("method_state_bytes", "ttft_s_p90", "ttft_s_p50", "ttft_s", "e2e_s", "kv_rel_error", "top1_agree"):
        assert old not in s, old  # one name per figure; fidelity figures under "fidelity" only


# ---- where the TTFT boundary falls --------------------------------------------------------------
def test_ttft_includes_reference_prefill_and_gate_but_not_deferred_anchor_insertion(engine, monkeypatch):
    """A clock the instrumented steps advance by known amounts: reference prefill 10 s, gate 1 s,
    deferred anchor insertion 100 s. TTFT holds 11 s of them, E2E all 111 s."""
    from kvcmas_bench.methods.delta import OnlineDeltaCorrection

    offset = [0.0]
    real_now = Engine.now
    monkeypatch.setattr(Engine, "now", lambda self: real_now(self) + offset[0])

    def advancing(fn, seconds):
        def wrapped(*a, **kw):
            offset[0] += seconds
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(Engine, "prefill_alone", advancing(Engine.prefill_alone, 10.0))
    monkeypatch.setattr(OnlineDeltaCorrection, "gate", advancing(OnlineDeltaCorrection.gate, 1.0))
    monkeypatch.setattr(OnlineDeltaCorrection, "insert", advancing(OnlineDeltaCorrection.insert, 100.0))
    m = get_method("kvcmas-nonchained", anchors=1, rank=None)
    q = rand_ids(15, 60)
    res = engine.run(req("A", PF_A, {"q": q}), m)  # reference prefill + gate (no anchor) + fallback
    assert res.segments[1].status == "exact" and m.stats["anchors_inserted"] == 1
    assert 11.0 <= res.ttft_s < 100.0
    assert res.e2e_s >= 111.0
    again = engine.run(req("A", PF_A, {"q": q}), m)  # cached reference, gate, accepted: 1 s
    assert again.segments[1].status == "corrected" and 1.0 <= again.ttft_s < 10.0


# ---- consumers are workflow nodes ---------------------------------------------------------------
def test_nodes_with_the_same_role_are_different_consumers(tiny_model_dir):
    from kvcmas_bench.calibration import collect
    from kvcmas_bench.modeling import load_model
    from kvcmas_bench.workflow import Workflow

    lm = load_model(tiny_model_dir, device="cpu")
    eng = Engine(lm.model, lm.tokenizer)
    mmlu = get_workload("mmlu")
    sample = mmlu.load()[3]
    flow = Workflow(eng, None, mmlu, 2, 2, agents=8)
    critics = [n.id for n in flow.nodes if n.role.name == "Critic"]
    assert len(critics) == 2 and critics[0] != critics[1]
    obs = collect(lambda m: Workflow(eng, m, mmlu, 2, 2, agents=8), [sample], with_reference=True)
    consumers = {o.consumer for o in obs if o.slot == "q"}
    assert set(critics) <= consumers and len(consumers) == 8
    gf = get_method("graphflow")
    gf.calibrate(obs, eng.n_layers)
    assert {("q", c) for c in critics} <= set(gf.corrections)
    m = get_method("kvcmas", anchors=10)
    rounds = Workflow(eng, m, mmlu, 2, 2, agents=4, rounds=2)
    rounds.run_sample(sample)
    nodes = [n.id for n in rounds.nodes]
    roles = [n.role.name for n in rounds.nodes]
    assert len(set(nodes)) == len(nodes) and len(set(roles)) < len(roles)
    consumers = {c for a in m.pools["q"].anchors for c in a.entries}
    assert consumers == set(nodes[1:])  # every consumer node of q, the repeated roles apart


# ---- KVComm keeps its own defaults -----------------------------------------------------------------
def test_kvcomm_uses_its_own_gamma_and_refuses_rank():
    mmlu = get_workload("mmlu")
    assert resolve_method("kvcomm", {}, mmlu)().tau == 0.3
    assert resolve_method("kvcmas", {}, mmlu)().tau == 0.29
    assert resolve_method("kvcomm", {"tau": 0.5}, mmlu)().tau == 0.5
    with pytest.raises(OptionError, match="--rank does not apply"):
        resolve_method("kvcomm", {"rank": 16}, mmlu)
    assert resolve_method("kvcomm", {}, mmlu)().rank is None


# ---- accounting ------------------------------------------------------------------------------------
def test_accounting_aggregates_counters_statuses_and_gate_distributions(engine):
    m = get_method("kvcmas", anchors=4, tau=1.0, rank=8)
    recs = []
    for i in range(3):
        q = rand_ids(15, 70 + i)  # different questions: distinct anchors, an entropy below 1
        a = engine.run(req("A", PF_A, {"q": q}), m)
        before = m.counters()
        b = engine.run(req("B", PF_B, {"q": q}), m, sources={"q": a.materialized["q"]})
        stats = {k: v - before.get(k, 0) for k, v in m.counters().items() if v != before.get(k, 0)}
        recs.append(RequestRecord("B", b.ttft_s, b.e2e_s, step=i, segments=b.segments, method_stats=stats))
    acc = accounting(recs)
    # passes 1-2: fewer than two anchors -> dense fallback + insertion; pass 3: accepted
    assert acc["dense_fallback"] == 2 and acc["anchors_inserted"] == 2 and acc["accepted"] == 1
    assert acc["segments"] == {"exact": 2, "corrected": 1}
    assert acc["gate"] == {"too_few_anchors": 2, "accepted": 1}
    assert acc["gate_entropy"]["n"] == 1 and acc["compare_tokens"]["max"] == 15
    assert acc["anchors_used"]["n"] == 1


# ---- resume with persisted method state -------------------------------------------------------------
def _records(path) -> list[dict]:
    drop = {
        "ttft_s",
        "e2e_s",
        "latency_s",
        "peak_rss_bytes",
        "peak_mem_bytes",
        "device_peak_bytes",
        "materialize_s",
        "deferred_s",
    }

    def clean(d):
        if isinstance(d, dict):
            return {k: clean(v) for k, v in d.items() if k not in drop}
        if isinstance(d, list):
            return [clean(x) for x in d]
        return d

    return [clean(json.loads(x)) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("method", ["kvcmas", "kvcomm"])
def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tiny_model_dir, tmp_path, monkeypatch, method):
    from kvcmas_bench.jobs import run as runner

    base = [
        "run",
        "--method",
        method,
        "--tau",
        "1",
        "--model",
        tiny_model_dir,
        "--limit",
        "5",
        "--max-new-tokens",
        "2",
        "--final-max-new-tokens",
        "2",
        "--device",
        "cpu",
    ]
    assert run_cli([*base, "-o", str(tmp_path / "whole")]) == 0
    real = interrupt_on_call(monkeypatch, runner, "run_one", 3)
    assert run_cli([*base, "-o", str(tmp_path / "cut")]) == 130
    monkeypatch.setattr(runner, "run_one", real)
    assert run_cli([*base, "-o", str(tmp_path / "cut")]) == 0
    for f in ("samples.jsonl", "requests.jsonl"):
        assert _records(tmp_path / "cut" / f) == _records(tmp_path / "whole" / f), f
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert whole["accounting"].get("accepted", 0) > 0  # the pools mattered: later samples reuse
    assert sorted(p.name for p in (tmp_path / "cut" / "method_state").glob("manifest-*")) == ["manifest-5.json"]


def test_resume_without_saved_method_state_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    base = [
        "run",
        "--method",
        "kvcmas",
        "--model",
        tiny_model_dir,
        "--limit",
        "2",
        "--max-new-tokens",
        "2",
        "--final-max-new-tokens",
        "2",
        "--device",
        "cpu",
        "-o",
        str(out),
    ]
    assert run_cli([*base[:6], "1", *base[7:]]) == 0
    for p in (out / "method_state").glob("manifest-*"):
        p.unlink()
    assert run_cli(base) == 2


def test_method_state_files_cannot_import_arbitrary_classes(tmp_path):
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.results.state import MethodStateStore

    m = get_method("kvcmas")
    store = MethodStateStore(tmp_path)
    store.save(1, m, 0)
    path = tmp_path / "method_state" / "manifest-1.json"
    body = json.loads(path.read_text())
    body["state"] = {"__dataclass__": "os:system", "fields": {}}
    path.write_text(json.dumps(body))
    with pytest.raises(BenchError, match="refusing to restore"):
        store.load(1, m)
