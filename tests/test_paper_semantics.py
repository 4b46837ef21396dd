"""KVCMAS measured as the paper defines it (Appendix A.3, C.3), on the tiny random-weight model:

- one pool per slot of at most V anchors; an anchor is one instance of the slot's content with one
  entry (source representation + correction) per consumer node; V = 1 bypasses the gate;
- the KV error of a segment is measured against a full dense prefill of the same prompt;
- KVComm gates with the anchors covering the whole segment only.

Expected values are computed here directly from the reconstructed anchors and a dense forward, not
with the implementation's kernels.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvcmas_bench.engine import Engine
from kvcmas_bench.methods import METHODS, Method, get_method, register
from kvcmas_bench.methods.anchors import AnchorPool
from kvcmas_bench.ops.kvmath import shift_keys
from kvcmas_bench.segments import Request, Segment

from .conftest import rand_ids, run_cli, smooth_tiny_model

NODES = ("A#0", "B#1", "C#2", "D#3")
PF = {n: rand_ids(5 + i, 100 + i) for i, n in enumerate(NODES)}
TAIL = rand_ids(3, 99)


@pytest.fixture(scope="module")
def smooth_engine():
    """Small weights (std 0.05): caches vary smoothly with the content, as on a real model."""
    return Engine(smooth_tiny_model())


def chain_request(node: str, q: list[int], r: list[int] | None = None) -> Request:
    segs = [Segment("PF", PF[node]), Segment("PH", q, slot="q"), Segment("PF", rand_ids(2, 7))]
    if r is not None:
        segs += [Segment("PH", r, slot="r"), Segment("PF", rand_ids(2, 8))]
    segs.append(Segment("PF", TAIL))
    return Request(node.split("#")[0], segs, 2, node=node)


def chain(engine, m, q, nodes=NODES, fidelity=False):
    """One sample through the chain A -> B -> C -> D: each node's source is the previous node's
    materialized cache of the slot."""
    out, src = [], None
    for node in nodes:
        res = engine.run(chain_request(node, q), m, sources={"q": src} if src is not None else {}, fidelity=fidelity)
        src = res.materialized["q"]
        out.append(res)
    return out


def rows(x: torch.Tensor) -> torch.Tensor:
    L, H, S, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(L, S, H * d).float()


def recon(f, n: int) -> torch.Tensor:
    return f.a[:, :n].float() if f.b is None else torch.matmul(f.a[:, :n].float(), f.b.float())


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return math.sqrt(float(((x.double() - ref.double()) ** 2).sum()) / float((ref.double() ** 2).sum()))


def dense_rows(engine, request: Request, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows of a full dense prefill of the whole prompt by a plain transformers forward (the
    model's own ``forward`` with its cache: no code of this project), as [layers, heads, rows, dim]."""
    with torch.no_grad():
        out = engine.model(input_ids=torch.tensor([request.prompt_ids]), use_cache=True)
    cache = out.past_key_values
    k = torch.stack([layer.keys[0, :, start : start + length] for layer in cache.layers])
    v = torch.stack([layer.values[0, :, start : start + length] for layer in cache.layers])
    return k, v


# ---- pools: V anchors per slot, an entry per consumer ---------------------------------------------
def test_v1_chain_corrects_every_eligible_segment_after_the_first_sample(engine):
    m = get_method("kvcmas", anchors=1, rank=4)
    first = chain(engine, m, rand_ids(12, 1))
    assert [r.segments[1].status for r in first] == ["exact"] * 4  # nothing stored yet: dense
    (anchor,) = m.pools["q"].anchors
    assert sorted(anchor.entries) == ["B#1", "C#2", "D#3"]  # one instance, three consumers
    for seed in (2, 3, 4):  # other questions: every consumer corrects with the sole anchor
        res = chain(engine, m, rand_ids(12, seed))
        assert [r.segments[1].status for r in res] == ["exact", "corrected", "corrected", "corrected"]
        assert all(r.segments[1].gate == "bypassed" for r in res[1:])
    assert len(m.pools["q"].anchors) == 1 and m.stats["accepted"] == 9 and m.stats["dense_fallback"] == 3


def test_v1_chain_with_an_exact_full_rank_anchor_reproduces_dense(engine):
    q = rand_ids(12, 5)
    m = get_method("kvcmas", anchors=1, rank=64)  # S = 12 < D = 32: rank 64 is exact
    chain(engine, m, q)
    res = chain(engine, m, q, fidelity=True)
    assert [r.segments[1].status for r in res] == ["exact", "corrected", "corrected", "corrected"]
    dense = get_method("nonshared")
    for r, node in zip(res, NODES):
        assert r.segments[1].kv_rel_error < 1e-5
        ref = engine.run(chain_request(node, q), dense)
        assert r.first_token_id == ref.first_token_id


def test_anchors_per_consumer_after_n_samples_is_min_n_v(engine):
    # a gate that always rejects (near-flat scores): every eligible segment falls back and stores
    m = get_method("kvcmas", anchors=3, rank=4, gate_mode="scaled", gate_temperature=1e6, tau=0.0)
    for n in range(1, 6):
        chain(engine, m, rand_ids(10 + n, 20 + n))
        pool = m.pools["q"]
        for consumer in NODES[1:]:
            assert len(pool.lengths(consumer)) == min(n, 3), (n, consumer)
        assert len(pool.anchors) == min(n, 3)
        assert all(sorted(a.entries) == list(NODES[1:]) for a in pool.anchors)
    assert pool.evicted == 2 and m.stats["anchors_inserted"] == 5 and m.stats["entries_inserted"] == 15


def test_eviction_removes_a_whole_anchor_and_state_bytes_count_its_entries(engine):
    m = get_method("kvcmas", anchors=2, rank=4, gate_mode="scaled", gate_temperature=1e6, tau=0.0)
    for seed in (31, 32, 33):
        chain(engine, m, rand_ids(10, seed), nodes=NODES[:3])
    pool = m.pools["q"]
    assert [a.created for a in pool.anchors] == [1, 2]  # the oldest (unused) instance went, whole
    L, D, S, r = engine.n_layers, engine.n_kv * engine.head_dim, 10, 4
    per_matrix = (L * S * r + L * r * D) * 4 + S * 4  # A, B and the row norms, float32
    # per anchor: two consumers (B, C), each with its own base (chained: different sources) and delta
    assert pool.nbytes == 2 * 2 * 4 * per_matrix
    layout = m.state_layout()["total"]
    assert layout["anchors"] == 2 and layout["entries"] == 4
    assert layout["bytes_per_entry"] == 4 * per_matrix and layout["bytes_per_anchor"] == 8 * per_matrix


def test_the_same_question_twice_gives_two_anchors_with_their_own_entries(engine):
    """Each dense fallback adds an anchor (A.3), also on content the pool already holds: the second
    observation of a question is a second anchor, its entries beside the first's, not over them."""
    m = get_method("kvcmas", anchors=3, rank=4, gate_mode="scaled", gate_temperature=1e6, tau=0.0)
    q = rand_ids(10, 35)
    chain(engine, m, q, nodes=NODES[:3])
    pool = m.pools["q"]
    (first,) = pool.anchors
    kept = {c: e.delta_v.a for c, e in first.entries.items()}
    chain(engine, m, q, nodes=NODES[:3])  # one anchor per consumer: too few to compare, dense again
    assert [(a.id, sorted(a.entries)) for a in pool.anchors] == [(0, ["B#1", "C#2"]), (1, ["B#1", "C#2"])]
    assert all(first.entries[c].delta_v.a is t for c, t in kept.items())  # the first anchor as it was
    assert m.stats["anchors_inserted"] == 2 and m.stats["entries_inserted"] == 4
    assert pool.lengths("B#1") == [10, 10]


def test_an_anchor_the_gate_used_outlives_a_newer_unused_one(engine):
    """LFU, not FIFO, with use counts raised by the gate itself: V = 2, anchor 0 (question 1) is
    used by an accepted gate, anchor 1 (question 2) never; a third question's fallback evicts
    anchor 1 (FIFO would evict anchor 0)."""
    m = get_method("kvcmas", anchors=2, rank=None, tau=0.3)
    q1, q2, q3 = rand_ids(10, 36), rand_ids(10, 37), rand_ids(10, 38)
    _fill_distinct_ids(engine, m, (q1, q2), nodes=NODES[:2])
    pool = m.pools["q"]
    assert [(a.id, a.count) for a in pool.anchors] == [(0, 0), (1, 0)]
    # question 1 again: B's source equals anchor 0's base exactly (distance 0), the gate is one-hot
    (_, b) = chain(engine, m, q1, nodes=NODES[:2])
    assert b.segments[1].gate == "accepted" and b.segments[1].details["anchors_used"] == 1
    assert [(a.id, a.count) for a in pool.anchors] == [(0, 1), (1, 0)]
    _fill_distinct_ids(engine, m, (q3,), nodes=NODES[:2])  # a fallback in a full pool
    assert [a.id for a in pool.anchors] == [0, 2]  # FIFO would leave [1, 2]
    assert pool.evicted == 1


def test_nonchained_entries_share_one_base(engine):
    m = get_method("kvcmas-nonchained", anchors=2, rank=4, gate_mode="scaled", gate_temperature=1e6, tau=0.0)
    chain(engine, m, rand_ids(10, 41), nodes=NODES[:3])
    (anchor,) = m.pools["q"].anchors
    assert sorted(anchor.entries) == list(NODES[:3])  # the first agent is a consumer too
    bases = {id(e.base_k) for e in anchor.entries.values()}
    assert len(bases) == 1  # one context-free reference, stored once
    L, D, S, r = engine.n_layers, engine.n_kv * engine.head_dim, 10, 4
    per_matrix = (L * S * r + L * r * D) * 4 + S * 4
    assert anchor.nbytes == (2 + 3 * 2) * per_matrix  # one base (K, V) + three deltas (K, V)


# ---- the gate and the weights on a chain with distinct questions ----------------------------------
def _fill_distinct(engine, m, seeds, nodes=NODES[:3]):
    _fill_distinct_ids(engine, m, [rand_ids(12, seed) for seed in seeds], nodes)


def _fill_distinct_ids(engine, m, questions, nodes=NODES[:3]):
    """Every question through the chain with a gate that always rejects: each stores an anchor."""
    rejecting = (m.gate_mode, m.gate_temperature, m.tau)
    m.gate_mode, m.gate_temperature, m.tau = "scaled", 1e6, 0.0  # store every question
    for q in questions:
        chain(engine, m, q, nodes=nodes)
    m.gate_mode, m.gate_temperature, m.tau = rejecting


def _by_hand(engine, src, anchors, consumer, start, lowrank, temperature=1.0):
    """Gate distances (Eq. 9) and the corrected K/V with token weights computed from reconstructed
    anchors: mean absolute distance for full-dimensional anchors, RMS for low-rank ones."""
    inv = engine.inv_freq
    S = src.length
    x_k, x_v = rows(shift_keys(src.k, -src.start, inv)), rows(src.v)
    d_gate = [math.sqrt(float(((x_v - recon(a.factor("base_v", consumer), S)) ** 2).sum())) for a in anchors]
    out = {}
    for part, x in (("k", x_k), ("v", x_v)):
        bases = [recon(a.factor(f"base_{part}", consumer), S) for a in anchors]
        if lowrank:
            dist = torch.stack([((x - b) ** 2).mean(dim=(0, 2)).sqrt() for b in bases])
        else:
            dist = torch.stack([(x - b).abs().mean(dim=(0, 2)) for b in bases])
        w = torch.softmax(-dist / temperature, dim=0)
        y = x.clone()
        for v, a in enumerate(anchors):
            y += w[v][None, :, None] * recon(a.factor(f"delta_{part}", consumer), S)
        L, _, D = y.shape
        out[part] = y.reshape(L, S, engine.n_kv, D // engine.n_kv).permute(0, 2, 1, 3)
    return d_gate, shift_keys(out["k"], start, inv), out["v"]


def test_chain_gate_sees_anchors_with_distinct_distances_and_weights_match_a_direct_computation(smooth_engine):
    engine = smooth_engine
    for rank in (None, 6):
        m = get_method("kvcmas", anchors=4, rank=rank, tau=1.0)
        _fill_distinct(engine, m, (51, 52, 53))
        pool = m.pools["q"]
        assert all(len(pool.lengths(c)) == 3 for c in NODES[1:3])
        q = rand_ids(12, 60)  # a fourth question, none of the stored ones
        a = engine.run(chain_request("A#0", q), m)
        b = engine.run(chain_request("B#1", q), m, sources={"q": a.materialized["q"]})
        c = engine.run(chain_request("C#2", q), m, sources={"q": b.materialized["q"]})
        for res, src, consumer in ((b, a, "B#1"), (c, b, "C#2")):
            seg = res.segments[1]
            assert seg.status == "corrected" and seg.details["anchors_compared"] == 3
            anchors = pool.compatible(consumer, 12)
            d_gate, ek, ev = _by_hand(
                engine, src.materialized["q"], anchors, consumer, res.materialized["q"].start, rank is not None
            )
            got = seg.details["distances"]
            assert got == [float(f"{x:.6g}") for x in got]
            for x, y in zip(got, d_gate):
                assert abs(x - y) <= 1e-4 * y
            assert len({round(x, 3) for x in d_gate}) == 3  # distinct distances
            z = [math.exp(-(x - min(d_gate))) for x in d_gate]
            p = [x / sum(z) for x in z]
            h = -sum(q_ * math.log2(q_) for q_ in p if q_ > 0) / math.log2(3)
            assert abs(seg.details["entropy"] - h) < 1e-4
            kv = res.materialized["q"]
            assert torch.allclose(kv.k.float(), ek, atol=2e-4, rtol=1e-4)
            assert torch.allclose(kv.v.float(), ev, atol=2e-4, rtol=1e-4)


# ---- KV error against a full dense prefill ---------------------------------------------------------
def test_kv_error_after_a_corrected_segment_is_against_the_full_dense_prefill(engine):
    """PH_q corrected (an inexact rank-1 anchor), then PH_r dense: the r segment is exact given the
    cache the method built, but not equal to the full dense prefill's rows."""
    q, r = rand_ids(12, 70), rand_ids(9, 71)
    m = get_method("kvcmas", anchors=1, rank=1)
    a = engine.run(chain_request("A#0", q), m)
    engine.run(chain_request("B#1", q), m, sources={"q": a.materialized["q"]})  # stores B's entry
    a2 = engine.run(chain_request("A#0", q), m)
    req_b = chain_request("B#1", q, r)  # r has no source: dense
    res = engine.run(req_b, m, sources={"q": a2.materialized["q"]}, fidelity=True)
    seg_q, seg_r = res.segments[1], res.segments[3]
    assert seg_q.status == "corrected" and seg_r.status == "exact"
    start_r = sum(len(s.ids) for s in req_b.segments[:3])
    ek, ev = dense_rows(engine, req_b, start_r, len(r))
    got = res.materialized["r"]
    direct = rel(torch.stack([got.k, got.v]), torch.stack([ek, ev]))
    assert direct > 1e-3
    assert abs(seg_r.kv_rel_error - direct) <= 1e-5 * direct
    assert seg_r.local_kv_rel_error < 1e-6  # the conditional figure: exact given what came before
    start_q = len(PF["B#1"])
    qk, qv = dense_rows(engine, req_b, start_q, len(q))
    got_q = res.materialized["q"]
    assert abs(seg_q.kv_rel_error - rel(torch.stack([got_q.k, got_q.v]), torch.stack([qk, qv]))) < 1e-6
    per_layer = [rel(torch.stack([got.k[l], got.v[l]]), torch.stack([ek[l], ev[l]])) for l in range(engine.n_layers)]
    assert all(abs(x - y) <= 1e-5 * max(y, 1e-9) for x, y in zip(seg_r.kv_rel_error_per_layer, per_layer))


# ---- KVComm: only anchors covering the whole segment ---------------------------------------------
def test_kvcomm_gates_only_with_anchors_covering_the_segment():
    L, D = 2, 8
    g = torch.Generator().manual_seed(3)
    pool = AnchorPool(20)
    for i, S in enumerate((16, 10, 16)):
        z = torch.randn(L, S, D, generator=g)
        pool.add(f"i{i}", ("s", i), z, z, "B", 0.1 * z, 0.1 * z, None)
    ref_v = torch.randn(L, 16, D, generator=g)
    kvcomm, kvcmas = get_method("kvcomm", tau=1.0), get_method("kvcmas-nonchained", tau=1.0, rank=None)
    details: dict = {}
    dec = kvcomm.gate(pool, "B", ref_v, 16, details)
    assert dec is not None and dec.k == 16 and len(dec.anchors) == 2 and details["anchors_covering"] == 2
    del pool.anchors[2]  # one anchor covers 16 tokens: KVComm prefills densely
    details = {}
    assert kvcomm.gate(pool, "B", ref_v, 16, details) is None and details["gate"] == "too_few_anchors"
    details = {}  # the paper's variable-length rule corrects the 10 rows two anchors cover
    dec = kvcmas.gate(pool, "B", ref_v, 16, details)
    assert dec is not None and dec.k == 10 and len(dec.anchors) == 2


def test_kvcomm_layer0_is_counted_as_recomputation(engine):
    q = rand_ids(12, 80)
    m = get_method("kvcomm", anchors=1)
    engine.run(chain_request("A#0", q), m)
    res = engine.run(chain_request("A#0", q), m)
    seg = res.segments[1]
    assert seg.status == "corrected" and seg.recomputed_token_layers == 12  # 12 tokens x layer 0
    assert res.recomputed_token_layers == 12


# ---- peak memory per run ---------------------------------------------------------------------------
@dataclass
class Hog(Method):
    """Dense prefill that also touches a 384 MiB buffer: a large working set."""

    name: ClassVar[str] = "hog"
    summary: ClassVar[str] = "test only"

    def materialize(self, ctx):
        buf = torch.ones(384 * 2**20 // 4)
        buf.add_(1.0)
        del buf
        return ctx.dense()


@dataclass
class Lean(Method):
    """Dense prefill and nothing else: a small working set."""

    name: ClassVar[str] = "lean"
    summary: ClassVar[str] = "test only"


@pytest.fixture
def hog_and_lean():
    register(Hog)
    register(Lean)
    yield
    METHODS.pop(Hog.name, None)
    METHODS.pop(Lean.name, None)


def test_two_cells_of_one_suite_report_their_own_peaks_whatever_their_order(tiny_model_dir, tmp_path, hog_and_lean):
    """Without a reset per cell, the cell after the hog would report the hog's peak."""
    peaks = {}
    orders = (("hog", "lean"), ("lean", "hog"))
    for order in orders:
        out = tmp_path / "-".join(order)
        args = ["suite", "--methods", ",".join(order), "--workloads", "mmlu", "--model", tiny_model_dir]
        args += ["--limit", "1", "--max-new-tokens", "2", "--final-max-new-tokens", "2", "--device", "cpu"]
        assert run_cli([*args, "-o", str(out)]) == 0
        for name in order:
            summary = json.loads((out / "mmlu" / name / "summary.json").read_text())
            peaks[order, name] = summary["peak_mem_bytes"]
    for order in orders:
        assert peaks[order, "hog"] - peaks[order, "lean"] > 300 * 2**20, peaks
