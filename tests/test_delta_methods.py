"""Delta-correction methods (KVCMAS, KVComm, GraphFlow) against exact dense references."""

from __future__ import annotations

import math

import pytest
import torch

from kvcmas_bench.calibration import Recorder, tau_for_reuse
from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import AnchorPool
from kvcmas_bench.ops.kvmath import relative_error
from kvcmas_bench.ops.lowrank import (
    gate_entropy,
    lowrank_apply,
    lowrank_sqdist,
    lowrank_token_sqdist,
    row_sqnorms,
    to_rows,
    truncated_svd,
)
from kvcmas_bench.segments import Request, Segment

from .conftest import rand_ids
from .slow_reference import token_sqdist, weighted_lowrank


def _pair(q_seed=12, q_len=15):
    q = rand_ids(q_len, q_seed)
    ra = Request("A", [Segment("PF", rand_ids(6, 10)), Segment("PH", q, slot="q"), Segment("PF", rand_ids(4, 13))], 4)
    rb = Request(
        "B", [Segment("PF", rand_ids(9, 11)), Segment("PH", q, slot="q", source="A"), Segment("PF", rand_ids(5, 14))], 4
    )
    return ra, rb


def test_truncated_svd_error_falls_with_rank_and_is_exact_at_full_rank():
    torch.manual_seed(0)
    z = torch.randn(3, 20, 12) @ torch.randn(3, 12, 12)
    errs = []
    for r in (1, 2, 4, 8, 12):
        a, b = truncated_svd(z, r)
        assert a.shape == (3, 20, r) and b.shape == (3, r, 12)
        errs.append(relative_error(torch.bmm(a, b), z))
    assert all(e1 > e2 for e1, e2 in zip(errs, errs[1:]))
    assert errs[-1] < 1e-5


def test_lowrank_sqdist_identity_matches_direct():
    torch.manual_seed(1)
    x, a, b = torch.randn(4, 30, 16), torch.randn(4, 30, 5), torch.randn(4, 5, 16)
    direct = (x - torch.bmm(a, b)).square().sum()
    assert torch.allclose(lowrank_sqdist(x, a, b), direct, rtol=1e-4)


def test_weighted_lowrank_is_the_weighted_sum():
    torch.manual_seed(2)
    a, b, w = torch.randn(3, 2, 7, 4), torch.randn(3, 2, 4, 6), torch.softmax(torch.randn(3, 7), 0)
    ref = sum(w[v][None, :, None] * torch.bmm(a[v], b[v]) for v in range(3))
    assert torch.allclose(weighted_lowrank(w, a, b), ref, atol=1e-5)
    # the package's apply: per-anchor A factors, every B stacked along the rank
    b_all = b.permute(1, 0, 2, 3).reshape(2, 3 * 4, 6)
    assert torch.allclose(lowrank_apply(w, list(a), b_all, [4, 4, 4]), ref, atol=1e-5)


def test_gate_entropy_peaked_accepted_flat_rejected():
    h_peak, g = gate_entropy(torch.tensor([0.0, 9.0, 12.0]))
    h_flat, _ = gate_entropy(torch.tensor([5.0, 5.0, 5.0]))
    assert h_peak < 0.01 and int(g.argmax()) == 0
    assert abs(h_flat - 1.0) < 1e-6
    # closed form for two anchors at distance gap 1: p = sigmoid(1)
    p = 1 / (1 + math.exp(-1))
    h2, _ = gate_entropy(torch.tensor([0.0, 1.0]))
    assert abs(h2 - (-(p * math.log2(p) + (1 - p) * math.log2(1 - p)))) < 1e-9


def _fake_pool(cap, n, rank=None, L=2, S=8, D=6):
    pool = AnchorPool(cap)
    for i in range(n):
        z = torch.full((L, S, D), float(i))
        pool.add(f"src{i}", ("src", i), z, z, "B", z * 0.1, z * 0.1, rank)
    return pool


def test_gate_needs_two_compatible_anchors():
    m = get_method("kvcmas", tau=1.0)
    assert m.gate(_fake_pool(10, 0), "B", torch.zeros(2, 8, 6), 8) is None
    assert m.gate(_fake_pool(10, 1), "B", torch.zeros(2, 8, 6), 8) is None
    assert m.gate(_fake_pool(10, 2), "B", torch.zeros(2, 8, 6), 8) is not None
    assert m.gate(_fake_pool(10, 2), "C", torch.zeros(2, 8, 6), 8) is None  # no delta for consumer C
    m.tau = 0.5
    # distances 0 and sqrt(2 * 8 * 6) = 9.80: g = (1 - e, e) with e = 5.6e-5, entropy ~1e-3 -> accepted
    details = {}
    assert m.gate(_fake_pool(10, 2), "B", torch.zeros(2, 8, 6), 8, details) is not None
    assert details["gate"] == "accepted" and details["entropy"] < 2e-3
    # both anchors at the same distance: flat (entropy 1) -> rejected even with two anchors
    pool = _fake_pool(10, 2)
    pool.anchors[1].entries["B"].base_v = pool.anchors[0].entries["B"].base_v
    details = {}
    assert m.gate(pool, "B", torch.zeros(2, 8, 6), 8, details) is None
    assert details["gate"] == "rejected" and abs(details["entropy"] - 1.0) < 1e-9


def test_eviction_is_lfu_among_five_oldest():
    pool = _fake_pool(6, 6)
    for i, a in enumerate(pool.anchors):
        a.count = [3, 1, 2, 5, 4, 0][i]  # the newest has count 0 but is not among the 5 oldest
    z = torch.zeros(2, 8, 6)
    pool.add("src99", ("src", 99), z, z, "B", z, z, None)
    assert [a.entries["B"].source_key[1] for a in pool.anchors] == [0, 2, 3, 4, 5, 99]
    assert pool.evicted == 1


def test_anchor_bytes_follow_the_memory_formulas():
    V, L, S, D, r = 4, 3, 40, 24, 5
    low = _fake_pool(V, V, rank=r, L=L, S=S, D=D)
    full = _fake_pool(V, V, rank=None, L=L, S=S, D=D)
    # each anchor: base K and V + one consumer's delta K and V; float32; low-rank matrices also keep
    # their row norms (S floats each)
    assert low.nbytes == V * 4 * L * r * (S + D) * 4 + V * 4 * S * 4
    assert full.nbytes == V * 4 * L * S * D * 4
    assert low.nbytes < full.nbytes


def test_kvcmas_first_agent_is_bit_identical_to_nonshared(engine):
    ra, _ = _pair()
    a = engine.run(ra, get_method("nonshared"))
    b = engine.run(ra, get_method("kvcmas"))
    assert a.output_ids == b.output_ids
    assert torch.equal(a.materialized["q"].k, b.materialized["q"].k)
    assert torch.equal(a.materialized["q"].v, b.materialized["q"].v)
    assert b.segments[1].status == "exact"


def test_kvcmas_with_one_exact_anchor_reproduces_dense(engine):
    """V = 1 bypasses the gate; a full-rank anchor holding this very delta gives the dense cache."""
    ra, rb = _pair()
    m = get_method("kvcmas", anchors=1, rank=64)
    a = engine.run(ra, m)
    first = engine.run(rb, m, sources={"q": a.materialized["q"]})
    assert first.segments[1].status == "exact" and m.stats["anchors_inserted"] == 1
    second = engine.run(rb, m, sources={"q": a.materialized["q"]}, fidelity=True)
    assert second.segments[1].status == "corrected" and second.reused_tokens == len(rb.segments[1].ids)
    assert second.segments[1].kv_rel_error < 1e-5
    dense = engine.run(rb, get_method("nonshared"), fidelity=True)
    assert (second.first_logits - dense.first_logits).abs().max().item() < 1e-4
    assert second.output_ids == dense.output_ids
    # the anchor is not re-inserted after an accepted correction
    assert m.stats["anchors_inserted"] == 1 and len(m.pools["q"].anchors) == 1


def test_kvcmas_low_rank_anchor_beats_fullshared_on_the_same_question(engine):
    """A rank-4 anchor learned on the same question (a new source materialization) moves the cache
    towards dense; anchors from other questions: tests/test_metrics.py."""
    m = get_method("kvcmas", anchors=1, rank=4)
    ra, rb = _pair(q_seed=30)
    a = engine.run(ra, m)
    engine.run(rb, m, sources={"q": a.materialized["q"]})  # dense fallback -> anchor
    ra2, rb2 = _pair(q_seed=30)
    a2 = engine.run(ra2, m)
    got = engine.run(rb2, m, sources={"q": a2.materialized["q"]}, fidelity=True)
    full = engine.run(rb2, get_method("fullshared"), sources={"q": a2.materialized["q"]}, fidelity=True)
    assert got.segments[1].kv_rel_error < full.segments[1].kv_rel_error


@pytest.mark.parametrize("part", ["delta_k", "delta_v"])
def test_nonfinite_correction_falls_back_to_dense(engine, part):
    """A NaN in the V delta is found after the K rows were written into the request cache in
    place: the dense fallback must overwrite them (first token and KV error as NonShared's)."""
    ra, rb = _pair()
    m = get_method("kvcmas", anchors=1, rank=64)
    a = engine.run(ra, m)
    engine.run(rb, m, sources={"q": a.materialized["q"]})
    getattr(m.pools["q"].anchors[0].entries["B"], part).a[-1, -1, 0] = float("nan")
    res = engine.run(rb, m, sources={"q": a.materialized["q"]}, fidelity=True)
    assert res.segments[1].status == "exact" and m.stats["nonfinite_fallback"] == 1
    assert res.segments[1].kv_rel_error < 1e-6
    assert res.first_token_id == engine.run(rb, get_method("nonshared")).first_token_id
    assert bool(torch.isfinite(res.materialized["q"].k).all() and torch.isfinite(res.materialized["q"].v).all())


@pytest.mark.parametrize("name", ["kvcomm", "kvcmas-nonchained"])
def test_nonchained_methods_correct_the_first_agent_from_a_reference(engine, name):
    ra, _ = _pair()
    m = get_method(name, anchors=1, **({"rank": 64} if name != "kvcomm" else {}))
    first = engine.run(ra, m)
    assert first.reference_tokens == len(ra.segments[1].ids)
    again = engine.run(ra, m, fidelity=True)  # reference cached: no second reference prefill
    assert again.reference_tokens == 0
    assert again.segments[1].status == "corrected"
    assert again.segments[1].kv_rel_error < 1e-5
    if name == "kvcomm":
        assert all(e.base_k.b is None for e in m.pools["q"].anchors[0].entries.values())  # full-dimensional


def test_graphflow_calibrates_every_relation_first_agent_included(engine):
    ra, rb = _pair()
    S = len(ra.segments[1].ids)
    rec = Recorder(with_reference=True)
    a = engine.run(ra, rec)
    engine.run(rb, rec, sources={"q": a.materialized["q"]})
    # the first agent's segment has no source but GraphFlow serves it from the reference: observed too
    assert [(o.consumer, o.source is None) for o in rec.observations] == [("A", True), ("B", False)]
    gf = get_method("graphflow")
    gf.calibrate(rec.observations, engine.n_layers)
    res = engine.run(rb, gf, sources={"q": a.materialized["q"]}, fidelity=True)
    assert res.reference_tokens == S
    assert res.segments[1].status == "corrected" and res.segments[1].kv_rel_error < 1e-5
    first = engine.run(ra, gf, fidelity=True)  # calibrated on this very segment: exact, and reused
    assert first.segments[1].status == "corrected" and first.segments[1].kv_rel_error < 1e-5
    assert first.eligible_tokens == S and first.reused_tokens == S and first.reference_tokens == 0
    # a relation never calibrated is recorded as such (the plain reference), never as corrected
    only_b = get_method("graphflow")
    only_b.calibrate([o for o in rec.observations if o.consumer == "B"], engine.n_layers)
    plain = engine.run(ra, only_b, fidelity=True)
    assert plain.segments[1].status == "uncalibrated" and plain.reference_tokens == S
    assert plain.segments[1].kv_rel_error > 1e-3  # the reference is not agent A's cache
    assert only_b.counters() == {"uncalibrated": 1}


def test_tau_for_reuse_hits_the_target():
    ent = [(0.1, 10), (0.2, 10), (0.5, 10), (0.9, 10)]
    assert tau_for_reuse(ent, 0.5) == 0.2
    assert tau_for_reuse(ent, 0.75) == 0.5
    assert tau_for_reuse(ent, 1.0) == 0.9
    assert tau_for_reuse(ent, 0.0) < 0.1


def test_to_rows_layout():
    x = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    rows = to_rows(x)
    assert rows.shape == (2, 4, 15)
    assert torch.equal(rows[1, 2, 5:10], x[1, 1, 2])


def test_token_sqdist_matches_reconstruction():
    torch.manual_seed(3)
    x, a, b = torch.randn(4, 9, 16), torch.randn(3, 4, 9, 5), torch.randn(3, 4, 5, 16)
    ref = torch.stack([(x - torch.bmm(a[v], b[v])).square().sum(dim=(0, 2)) for v in range(3)])
    got = token_sqdist(x, a, b, orthonormal=False)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3)
    # SVD factors have orthonormal B rows, the shortcut the methods use
    z = torch.randn(3, 4, 9, 16)
    fa, fb = zip(*(truncated_svd(z[v], 5) for v in range(3)))
    fa, fb = torch.stack(fa), torch.stack(fb)
    assert torch.allclose(torch.matmul(fb, fb.transpose(-1, -2)), torch.eye(5).expand(3, 4, 5, 5), atol=1e-5)
    ref2 = torch.stack([(x - torch.bmm(fa[v], fb[v])).square().sum(dim=(0, 2)) for v in range(3)])
    assert torch.allclose(token_sqdist(x, fa, fb), ref2, rtol=1e-4, atol=1e-3)
    # the package's distances: one GEMM with every B^T side by side, then each anchor's A rows
    b_t = fb.permute(1, 0, 2, 3).reshape(4, 3 * 5, 16).transpose(1, 2).contiguous()
    x_sq, a_sq = x.square().sum(dim=(0, 2)), [row_sqnorms(fa[v]) for v in range(3)]
    got2 = lowrank_token_sqdist(x, x_sq, list(fa), a_sq, b_t, [5, 5, 5])
    assert torch.allclose(got2, ref2, rtol=1e-4, atol=1e-3)
    assert torch.allclose(got.sum(1), torch.stack([lowrank_sqdist(x, a[v], b[v]) for v in range(3)]), rtol=1e-4)


def test_anchors_of_different_ranks_are_gated_and_applied_together(engine):
    """Short segments give factors with fewer than ``rank`` components; they stack zero-padded."""
    m = get_method("kvcmas", tau=1.0, rank=8)
    pool = AnchorPool(10)
    torch.manual_seed(4)
    for i, S in enumerate((5, 12, 20)):  # ranks 5, 8, 8
        z = torch.randn(2, S, 16)
        pool.add(f"src{i}", ("src", i), z, z, "B", z * 0.1, z * 0.1, 8)
    m.pools["q"] = pool
    assert [a.entries["B"].base_v.a.shape[-1] for a in pool.anchors] == [5, 8, 8]
    x = torch.randn(2, 5, 16)
    dec = m.gate(pool, "B", x, 5)
    assert dec is not None and dec.k == 5 and len(dec.anchors) == 3
    ref = torch.stack([(x - a.entries["B"].base_v.rows(5)).square().sum(dim=(0, 2)) for a in pool.anchors])
    assert torch.allclose(dec.sqdist_v, ref, rtol=1e-4, atol=1e-3)
