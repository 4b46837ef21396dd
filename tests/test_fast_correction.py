"""The optimized delta correction (issue 13) against the slow reference it replaced: same caches to
float tolerance, the per-call B stacks follow the anchors' order, and the Gram
factorization equals the exact truncated SVD."""

from __future__ import annotations

import pytest
import torch

from kvcmas_bench.engine import Request, Segment
from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import AnchorPool, stack_b
from kvcmas_bench.ops.kvmath import relative_error, shift_keys
from kvcmas_bench.ops.lowrank import (
    HeadMajorRows,
    rows_to_keys,
    shift_to_rows,
    to_rows,
    token_sqnorms,
    truncated_svd,
    truncated_svd_gram,
)

from .conftest import rand_ids
from .slow_reference import reference_correction


def _requests(q):
    ra = Request("A", [Segment("PF", rand_ids(6, 10)), Segment("PH", q, slot="q"), Segment("PF", rand_ids(4, 13))], 2)
    rb = Request("B", [Segment("PF", rand_ids(9, 11)), Segment("PH", q, slot="q"), Segment("PF", rand_ids(5, 14))], 2)
    return ra, rb


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("short", [0, 4], ids=["k=S", "k<S"])
@pytest.mark.parametrize("rank", [3, 8])
@pytest.mark.parametrize("block", [256, 7], ids=["one-block", "blocks-of-7"])
def test_optimized_correction_equals_the_slow_reference(engine, dtype, short, rank, block, monkeypatch):
    """Also block by block: 7-row blocks split the 20-30 rows unevenly, the last block partly covered."""
    from kvcmas_bench.methods.delta import OnlineDeltaCorrection

    monkeypatch.setattr(OnlineDeltaCorrection, "block_tokens", block)
    q = rand_ids(20, 31)
    ra, rb = _requests(q)
    src = engine.run(ra, get_method("nonshared")).materialized["q"]
    S = len(q)
    m = get_method("kvcmas", tau=1.0, rank=rank, anchor_dtype=dtype)
    canon = torch.stack([to_rows(shift_keys(src.k, -src.start, engine.inv_freq)), to_rows(src.v)])
    g = torch.Generator().manual_seed(9)
    pool = AnchorPool(10)
    n = S - short
    for i, scale in enumerate((0.05, 0.3, 0.8)):
        base = canon[:, :, :n] + scale * torch.randn(canon[:, :, :n].shape, generator=g)
        dk, dv = torch.randn(base[0].shape, generator=g), torch.randn(base[0].shape, generator=g)
        pool.add(f"src{i}", ("src", i), base[0], base[1], "B", dk, dv, rank, getattr(torch, dtype))
    m.pools["q"] = pool
    got = engine.run(rb, m, sources={"q": src}).materialized["q"]
    assert got.status == "corrected"
    ek, ev = reference_correction(src, pool.anchors, "B", got.start, engine.inv_freq, engine.n_kv, n)
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16 GEMMs: ~3 significant digits
    assert relative_error(got.k, ek) < tol and relative_error(got.v, ev) < tol
    if short:  # rows beyond the covered prefix: the aligned source, exactly
        aligned = src.aligned(got.start, engine.inv_freq)
        assert torch.allclose(got.v[:, :, n:], aligned.v[:, :, n:])
        assert torch.allclose(got.k[:, :, n:], aligned.k[:, :, n:], atol=1e-5)


def test_stacked_b_factors_follow_anchor_order_and_are_not_kept_in_the_state():
    g = torch.Generator().manual_seed(3)
    pool = AnchorPool(capacity=4)
    for i, S in enumerate((3, 9, 16)):  # a 3-token segment has rank 3, the others rank 6
        z = torch.randn(2, S, 12, generator=g)
        pool.add(f"src{i}", ("src", i), z, z, "B", 0.1 * z, 0.2 * z, rank=6)
    pool.add(
        "src1",
        ("src", 1),
        pool.anchors[1].entries["B"].base_k.rows(99),
        pool.anchors[1].entries["B"].base_v.rows(99),
        "C",
        0.3 * z[:, :9],
        z[:, :9],
        rank=6,
    )
    mine = [pool.anchors[2], pool.anchors[0]]
    got = stack_b(mine, "B", "delta_v")
    assert got.shape == (2, 6 + 3, 12)
    assert torch.equal(got[:, :6], pool.anchors[2].entries["B"].delta_v.b)
    assert torch.equal(got[:, 6:], pool.anchors[0].entries["B"].delta_v.b)
    assert torch.equal(stack_b([pool.anchors[1]], "C", "base_k"), pool.anchors[1].entries["B"].base_k.b)

    # the state is the anchors' factors, nothing more: A [L, S, r], B [L, r, D] and the row norms [S]
    # per stored matrix; consumer C read the same source as B, so it shares B's base factors
    def fbytes(S, r):
        return 2 * (S * r + r * 12) * 4 + S * 4

    by_hand = 4 * fbytes(3, 3) + 4 * fbytes(9, 6) + 4 * fbytes(16, 6) + 2 * fbytes(9, 6)
    assert pool.nbytes == by_hand


def test_gram_factorization_equals_the_exact_truncated_svd():
    torch.manual_seed(0)
    for S, D, r in ((400, 48, 8), (400, 48, 48), (30, 48, 8), (64, 64, 16)):
        z = torch.randn(3, S, D) @ torch.randn(3, D, D) * torch.linspace(0.1, 3.0, D)
        a1, b1 = truncated_svd(z, r)
        a2, b2 = truncated_svd_gram(z, r)
        e1 = relative_error(torch.bmm(a1, b1), z)
        e2 = relative_error(torch.bmm(a2, b2), z)
        assert abs(e1 - e2) < 1e-4, (S, D, r, e1, e2)
        assert relative_error(torch.bmm(a2, b2), torch.bmm(a1, b1)) < 1e-3
        eye = torch.eye(b2.shape[1]).expand(3, -1, -1)
        assert torch.allclose(torch.bmm(b2, b2.transpose(1, 2)), eye, atol=1e-4)  # orthonormal rows


def test_fused_rotation_layouts_equal_rotate_then_permute():
    torch.manual_seed(1)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    k = torch.randn(3, 2, 37, 16)
    rows = shift_to_rows(k, -11, inv)
    assert torch.allclose(rows, to_rows(shift_keys(k, -11, inv)), atol=1e-6)
    back = rows_to_keys(rows, 11, inv, 2, torch.float32)
    assert back.is_contiguous() and torch.allclose(back, k, atol=1e-5)


def test_head_major_rows_are_the_row_layout_block_by_block():
    """``HeadMajorRows(x)[:, s:e]`` is row ``t`` = the heads of token ``t`` side by side, written by
    hand on a 1-layer, 2-head, 3-token, head_dim-2 cache; other keys are refused."""
    x = torch.arange(12, dtype=torch.float32).view(1, 2, 3, 2)  # head 0: tokens [0,1] [2,3] [4,5]; head 1: [6,7] ...
    rows = HeadMajorRows(x)
    assert rows.shape == (1, 3, 4)
    expected = torch.tensor([[[2.0, 3.0, 8.0, 9.0], [4.0, 5.0, 10.0, 11.0]]])
    got = rows[:, 1:3]
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    got.add_(1.0)  # a copy: the cache is untouched
    assert float(x[0, 0, 1, 0]) == 2.0
    with pytest.raises(IndexError):
        rows[0, 1:3]


def test_token_sqnorms_sum_over_layers_and_features():
    x = torch.tensor([[[1.0, 2.0], [3.0, 0.0]], [[0.0, 1.0], [2.0, 2.0]]])  # 2 layers, 2 tokens, D = 2
    assert torch.equal(token_sqnorms(x), torch.tensor([1.0 + 4.0 + 0.0 + 1.0, 9.0 + 0.0 + 4.0 + 4.0]))


def test_correction_never_writes_into_the_source_cache(engine):
    """A source whose values are stored token-major (its row layout is a view, as in vLLM's
    captures) must come out of a correction untouched: corrections go into the method's own rows."""
    q = rand_ids(20, 33)
    ra, rb = _requests(q)
    src = engine.run(ra, get_method("nonshared")).materialized["q"]
    src.v = src.v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # same values, token-major storage
    before_k, before_v = src.k.clone(), src.v.clone()
    m = get_method("kvcmas", anchors=1, rank=None)
    canon = torch.stack([to_rows(shift_keys(src.k, -src.start, engine.inv_freq)), to_rows(src.v)])
    m.pools["q"] = AnchorPool(1)
    m.pools["q"].add("s", ("s",), canon[0], canon[1], "B", torch.ones_like(canon[0]), torch.ones_like(canon[1]), None)
    got = engine.run(rb, m, sources={"q": src}).materialized["q"]
    assert got.status == "corrected"
    assert torch.equal(src.k, before_k) and torch.equal(src.v, before_v)


def test_correction_is_written_into_the_request_cache_and_detached_after_the_first_token(engine, monkeypatch):
    """No segment-sized buffer before the first token: the corrected rows are the request cache's
    own; after the first token the materialized segment owns a copy of exactly its rows (it must
    not pin the whole request cache), with the same values."""
    from kvcmas_bench.engine import KVCache, SegmentKV

    q = rand_ids(20, 35)
    ra, rb = _requests(q)
    src = engine.run(ra, get_method("nonshared")).materialized["q"]
    m = get_method("kvcmas", anchors=1, rank=None)
    canon = torch.stack([to_rows(shift_keys(src.k, -src.start, engine.inv_freq)), to_rows(src.v)])
    m.pools["q"] = AnchorPool(1)
    m.pools["q"].add(
        "s", ("s",), canon[0], canon[1], "B", 0.5 * torch.ones_like(canon[0]), torch.ones_like(canon[1]), None
    )
    seen = {}
    correct = type(m).correct

    def spy(self, ctx, *a, **kw):
        kv = correct(self, ctx, *a, **kw)
        seen["in_place"] = ctx.cache.holds(kv)
        seen["rows_at_first_token"] = kv.k.clone(), kv.v.clone()
        return kv

    monkeypatch.setattr(type(m), "correct", spy)
    writes = []
    monkeypatch.setattr(
        KVCache, "write", lambda self, kv, w=KVCache.write: (writes.append(self.holds(kv)), w(self, kv))
    )
    got = engine.run(rb, m, sources={"q": src}).materialized["q"]
    assert got.status == "corrected" and seen["in_place"] is True
    assert True in writes  # the engine saw the aliasing and copied nothing
    assert isinstance(got, SegmentKV) and got.k.untyped_storage().nbytes() == got.k.numel() * got.k.element_size()
    assert got.v.untyped_storage().nbytes() == got.v.numel() * got.v.element_size()
    k0, v0 = seen["rows_at_first_token"]
    assert torch.equal(got.k, k0) and torch.equal(got.v, v0)
    # the correction itself, by hand: V = aligned source + 1 (one anchor, weight 1), K + 0.5 before rotation
    assert torch.allclose(got.v, src.v + 1.0, atol=1e-6)
    aligned = src.aligned(got.start, engine.inv_freq)
    assert torch.allclose(
        got.k,
        shift_keys(shift_keys(aligned.k, -got.start, engine.inv_freq) + 0.5, got.start, engine.inv_freq),
        atol=1e-5,
    )
