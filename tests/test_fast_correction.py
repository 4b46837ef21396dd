"""The optimized delta correction (issue 13) against the slow reference it replaced: same caches to
float tolerance, the per-call B stacks follow the anchors' order, and the Gram
factorization equals the exact truncated SVD."""

from __future__ import annotations

import math

import pytest
import torch

from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import AnchorPool, stack_b
from kvcmas_bench.ops.kvmath import relative_error, shift_keys
from kvcmas_bench.ops.lowrank import (
    add_shift_into,
    factorize,
    factorize_many,
    from_rows,
    gram_matrices,
    operand_rows,
    rotate_rows,
    shift_to_rows,
    subspace_factors,
    to_rows,
    token_sqnorms,
    truncated_svd,
    truncated_svd_gram,
    truncated_svd_subspace,
)
from kvcmas_bench.segments import Request, Segment

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


def _known_spectrum(L: int, S: int, D: int, s: list[float], seed: int) -> tuple[torch.Tensor, ...]:
    """``L`` layers of ``U diag(s) V^T`` (float64) with random orthonormal ``U`` (``S x n``) and ``V``
    (``D x n``); returns the matrix, ``U`` and ``V``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(L, S, len(s), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(L, D, len(s), generator=g, dtype=torch.float64))[0]
    return (u * torch.tensor(s, dtype=torch.float64)) @ v.transpose(1, 2), u, v


def test_subspace_factorization_reaches_the_exact_truncation_of_a_known_spectrum():
    """Singular values 10, 9, ..., 3 then 1, 0.9, ..., 0.1 (a gap after the eighth): the best rank-8
    approximation is the first eight terms, with relative error sqrt(sum of the tail's squares /
    sum of all squares), by hand sqrt(3.85 / (380 + 3.85)) = 0.10015. The matrix has rank 18 < k = 24,
    so this checks the Rayleigh-Ritz step and B's orthonormal rows; the iterations themselves are
    held by the full-rank test below."""
    top = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    tail = [1.0 - 0.1 * i for i in range(10)]
    z64, u, v = _known_spectrum(3, 200, 64, top + tail, 0)
    z = z64.float()
    a, b = truncated_svd_subspace(z, 8)
    assert a.shape == (3, 200, 8) and b.shape == (3, 8, 64)
    assert abs(relative_error(torch.bmm(a, b), z) - math.sqrt(3.85 / 383.85)) < 1e-5
    best = (u[..., :8] * torch.tensor(top, dtype=torch.float64)) @ v[..., :8].transpose(1, 2)
    assert float((torch.bmm(a, b).double() - best).abs().max()) < 1e-4
    assert torch.allclose(torch.bmm(b, b.transpose(1, 2)), torch.eye(8).expand(3, -1, -1), atol=1e-5)


def test_subspace_factorization_converges_on_a_full_rank_spectrum():
    """Singular values 10, 9, ..., 3 then a full-rank tail 2.8 * 0.98^i (88 values, D = 96): the start
    block (24 columns) cannot span the matrix, so only the iterations find the top 8. The best rank-8
    error is sqrt(sum of the tail's squares / sum of all squares) (Eckart-Young on the spectrum built
    here); the default 8 iterations reach it to 1e-5 relative (2 iterations are 8e-5 off, 3 are 2e-5)."""
    top, tail = [10.0 - i for i in range(8)], [2.8 * 0.98**i for i in range(88)]
    z = _known_spectrum(3, 400, 96, top + tail, 5)[0].float()
    want = math.sqrt(sum(t * t for t in tail) / (sum(t * t for t in top) + sum(t * t for t in tail)))
    assert abs(relative_error(torch.bmm(*truncated_svd_subspace(z, 8)), z) / want - 1) < 1e-5


def test_subspace_factorization_of_a_layer_with_a_nan_is_nan_there_only():
    """As the Gram path: that layer's factors are non-finite (the correction then falls back to dense
    prefill), the other layers' are those of the same call without the NaN."""
    z = _known_spectrum(3, 200, 64, [float(30 - i) for i in range(30)], 6)[0].float()
    bad = z.clone()
    bad[1, 7, 3] = float("nan")
    a, b = truncated_svd_subspace(bad, 8)
    a0, b0 = truncated_svd_subspace(z, 8)
    assert not torch.isfinite(a[1]).all() and not torch.isfinite(b[1]).all()
    for i in (0, 2):
        assert torch.allclose(a[i], a0[i], atol=1e-5) and torch.allclose(b[i], b0[i], atol=1e-6)


def test_subspace_factorization_with_a_dominant_direction():
    """Singular values 1000, 10, 9, ..., 4 then 1, 0.9, ..., 0.1: the Gram matrix spans six orders of
    magnitude, where a single Cholesky QR per iteration loses the weaker directions in float32
    rounding. The best rank-8 error, by hand: sqrt(3.85 / (1e6 + 371 + 3.85)) = 1.9618e-3."""
    top = [1000.0, 10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0]
    z = _known_spectrum(2, 400, 96, top + [1.0 - 0.1 * i for i in range(10)], 3)[0].float()
    err = relative_error(torch.bmm(*truncated_svd_subspace(z, 8)), z)
    assert abs(err / (3.85 / (1e6 + 371 + 3.85)) ** 0.5 - 1) < 1e-3


def test_subspace_factorization_of_zero_and_rank_deficient_layers_is_exact():
    """Layer 0 all zeros (as a delta whose first layer does not depend on the prefix), layer 1 of
    rank 3 < r = 8: both reconstructed exactly, no NaN (the last orthonormalization drops the empty
    directions instead of dividing by them)."""
    z = torch.zeros(2, 100, 48)
    z[1] = _known_spectrum(1, 100, 48, [5.0, 2.0, 1.0], 1)[0][0].float()
    a, b = truncated_svd_subspace(z, 8)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert float(torch.bmm(a, b)[0].abs().max()) == 0.0
    assert float((torch.bmm(a, b)[1] - z[1]).abs().max()) < 1e-5


def test_subspace_orthonormalization_uses_eigh_only_for_degenerate_layers(monkeypatch):
    """The last orthonormalization: a Cholesky factor for well-conditioned layers, the eigenvectors
    of ``X^T X`` only for degenerate ones (here an all-zero layer), so a healthy call runs one host
    ``eigh`` (the Rayleigh-Ritz step) over its layers, and a call with one zero layer one more over
    that layer alone."""
    calls = []
    real = torch.linalg.eigh

    def spy(m, *a, **kw):
        calls.append(m.shape[0])
        return real(m, *a, **kw)

    monkeypatch.setattr(torch.linalg, "eigh", spy)
    z = _known_spectrum(3, 150, 64, [float(30 - i) for i in range(30)], 2)[0].float()
    truncated_svd_subspace(z, 8)
    assert calls == [3]
    calls.clear()
    z[0] = 0.0
    a, b = truncated_svd_subspace(z, 8)
    assert calls == [1, 3]
    assert float(torch.bmm(a, b)[0].abs().max()) == 0.0
    assert torch.allclose(torch.bmm(b[1:], b[1:].transpose(1, 2)), torch.eye(8).expand(2, -1, -1), atol=1e-5)


def test_orthonormalizer_drops_a_nearly_dependent_column_instead_of_amplifying_it():
    """``X`` with column 5 = column 3 + 1e-9 noise: its Cholesky factorization succeeds with a pivot
    ~1e-7, so the guard (not the Cholesky's own failure) must send the layer to the eigenvector route,
    which keeps 7 orthonormal columns and zeroes the eighth; ``R^{-1}`` would amplify the noise by 1e7
    (orthonormal only to ~eps cond^2 ~ 0.4)."""
    from kvcmas_bench.ops.lowrank import _orthonormalizer

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 8, generator=g, dtype=torch.float64)
    x[0, :, 5] = x[0, :, 3] + 1e-9 * torch.randn(64, generator=g, dtype=torch.float64)
    m = x.transpose(1, 2) @ x
    assert int(torch.linalg.cholesky_ex(m)[1][0]) == 0  # the factorization itself does not fail
    q = x @ _orthonormalizer(m)
    qq = q.transpose(1, 2) @ q
    assert torch.allclose(qq[1], torch.eye(8, dtype=torch.float64), atol=1e-10)  # the healthy layer
    norms = qq[0].diagonal()
    assert int((norms < 1e-12).sum()) == 1 and int(((norms - 1).abs() < 1e-8).sum()) == 7
    assert torch.allclose(qq[0], torch.diag(norms), atol=1e-8)


def test_subspace_factorization_is_deterministic_and_auto_is_gram_on_the_cpu():
    z = _known_spectrum(2, 150, 64, [float(30 - i) for i in range(30)], 2)[0].float()
    a1, b1 = truncated_svd_subspace(z, 8)
    a2, b2 = truncated_svd_subspace(z, 8)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)  # seeded start: the same factors every call
    ag, bg = truncated_svd_gram(z, 8)
    af, bf = factorize(z, 8)
    assert torch.equal(af, ag) and torch.equal(bf, bg)
    for S in (40, 20):  # segments not longer than D, and shorter than the start block (24 columns)
        short = z[:, :S]
        best = relative_error(torch.bmm(*truncated_svd(short, 8)), short)
        assert abs(relative_error(torch.bmm(*truncated_svd_subspace(short, 8)), short) / best - 1) < 1e-5


def test_subspace_factors_of_several_stacks_equal_each_alone():
    """An anchor entry's stacks (here three, of two lengths) factorized in one iteration give each
    stack the factors of its own call: the batched GEMMs and eigenproblems are per matrix and every
    stack starts from the same seeded block."""
    zs = [
        _known_spectrum(2, 150, 64, [float(30 - i) for i in range(30)], 2)[0].float(),
        _known_spectrum(2, 150, 64, [1000.0] + [float(20 - i) for i in range(20)], 7)[0].float(),
        _known_spectrum(2, 90, 64, [float(12 - i) for i in range(12)], 8)[0].float(),
    ]
    together = subspace_factors(zs, 8)
    for z, (a, b) in zip(zs, together):
        a1, b1 = truncated_svd_subspace(z, 8)
        assert a.shape == a1.shape and b.shape == b1.shape
        assert torch.allclose(a, a1, atol=1e-5, rtol=1e-5) and torch.allclose(b, b1, atol=1e-6)
    assert [f[0].shape[1] for f in factorize_many(zs, 8, "subspace")] == [150, 150, 90]


def test_bfloat16_gram_matrices_are_those_of_the_rounded_rows():
    """``gram_matrices(z, bfloat16)``: the Gram matrix of z rounded to bfloat16 (computed here in
    float64 from the rounded values), not of z itself (values chosen with low mantissa bits that
    bfloat16 drops: 1 + 2^-10 rounds to 1)."""
    z = torch.full((1, 3, 2), 1.0 + 2.0**-10)
    z[0, :, 1] = 3.0
    assert torch.equal(gram_matrices(z, torch.bfloat16), torch.tensor([[[3.0, 9.0], [9.0, 27.0]]]))
    assert float(gram_matrices(z)[0, 0, 0]) == pytest.approx(3 * (1 + 2.0**-10) ** 2, rel=1e-7)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 50, 16, generator=g)
    zr = z.to(torch.bfloat16).double()
    assert torch.allclose(gram_matrices(z, torch.bfloat16).double(), zr.transpose(1, 2) @ zr, rtol=1e-6, atol=1e-5)


def test_subspace_factorization_with_a_bfloat16_gram_stays_at_the_exact_truncation():
    """The known spectrum above (best rank-8 error sqrt(3.85 / 383.85) by hand) factorized from the
    Gram matrix of its bfloat16-rounded rows: the rounding (relative 2^-9 per entry) perturbs the
    subspace to first order and the error only to second order, so it stays within 1e-3 of the best;
    ``A = Z V`` still uses the unrounded rows."""
    top = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    z = _known_spectrum(3, 200, 64, top + [1.0 - 0.1 * i for i in range(10)], 0)[0].float()
    a, b = truncated_svd_subspace(z, 8, gram_dtype=torch.bfloat16)
    err = relative_error(torch.bmm(a, b), z)
    assert err >= math.sqrt(3.85 / 383.85) * (1 - 1e-6)
    assert err / math.sqrt(3.85 / 383.85) - 1 < 1e-3
    assert not torch.equal(a, truncated_svd_subspace(z, 8)[0])  # the rounded Gram really was used


def test_anchor_insertion_factorizes_an_entry_in_one_call_per_rank(monkeypatch):
    """Pool insertion with svd=subspace: one factorization call for an entry's deltas and bases of one
    rank (two calls when delta_rank differs), only the deltas when the entry shares another entry's
    base; the bfloat16 Gram when the factors are stored in bfloat16."""
    from kvcmas_bench.ops import lowrank

    calls = []
    real = lowrank.subspace_factors

    def spy(zs, rank, *a, **kw):
        calls.append((len(zs), rank, kw.get("gram_dtype")))
        return real(zs, rank, *a, **kw)

    monkeypatch.setattr(lowrank, "subspace_factors", spy)
    z = [_known_spectrum(2, 60, 40, [float(10 - i) for i in range(10)], i)[0].float() for i in range(4)]
    pool = AnchorPool(4)
    pool.add("x", ("src",), z[0], z[1], "B", z[2], z[3], 4, None, "subspace")
    assert calls == [(4, 4, torch.float32)]
    pool.add("x", ("src",), z[0], z[1], "C", z[2], z[3], 4, None, "subspace")
    assert calls[1] == (2, 4, torch.float32)  # the base is B's
    pool.add("y", ("s2",), z[0], z[1], "B", z[2], z[3], 4, torch.bfloat16, "subspace", delta_rank=2)
    assert calls[2:] == [(2, 2, torch.bfloat16), (2, 4, torch.bfloat16)]
    e = pool.anchors[1].entries["B"]
    assert e.delta_k.rank == 2 and e.base_k.rank == 4 and e.base_v.a.dtype == torch.bfloat16


def test_a_failed_factorization_leaves_the_pool_as_it_was(monkeypatch):
    """The factors are computed before the pool changes: a factorization that raises (e.g. out of
    device memory; the vLLM worker's loop carries on after it) evicts nothing and adds no empty anchor."""
    from kvcmas_bench.methods import anchors

    z = [_known_spectrum(2, 60, 40, [float(10 - i) for i in range(10)], i)[0].float() for i in range(4)]
    pool = AnchorPool(1)
    pool.add("x", ("src",), z[0], z[1], "B", z[2], z[3], 4)

    def boom(*a, **kw):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(anchors, "factorize_many", boom)
    with pytest.raises(RuntimeError):
        pool.add("y", ("s2",), z[0], z[1], "B", z[2], z[3], 4)
    with pytest.raises(RuntimeError):
        pool.add("x", ("other",), z[0], z[1], "C", z[2], z[3], 4)
    assert [(a.instance, list(a.entries)) for a in pool.anchors] == [("x", ["B"])]
    assert pool.evicted == 0 and pool.inserted == 1


def test_make_all_keeps_each_stacks_dtype_when_none_is_given():
    from kvcmas_bench.methods.anchors import Factor

    z = _known_spectrum(2, 60, 40, [float(10 - i) for i in range(10)], 1)[0].float()
    made = Factor.make_all([(z, 8), (z.bfloat16(), 8), (z.bfloat16(), None)], None, "gram")
    assert [f.a.dtype for f in made] == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert [f.b.dtype for f in made[:2]] == [torch.float32, torch.bfloat16] and made[2].b is None


def test_fused_rotation_layout_equals_rotate_then_permute():
    torch.manual_seed(1)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    k = torch.randn(3, 2, 37, 16)
    rows = shift_to_rows(k, -11, inv)
    assert torch.allclose(rows, to_rows(shift_keys(k, -11, inv)), atol=1e-6)


def test_rotating_b_rotates_the_rows_of_a_key_factor():
    """By hand: one head of dim 2 (one frequency, 0.25 rad per position), ``B`` the identity: rotated
    by 2 positions its rows are ``[cos .5, sin .5]`` and ``[-sin .5, cos .5]`` (HF's rotate_half
    convention). Then ``A rotate_rows(B, d)`` is ``A B`` rotated by ``d`` positions (two heads, 8-dim),
    and orthonormal rows stay orthonormal."""
    c, s = math.cos(0.5), math.sin(0.5)
    got = rotate_rows(torch.eye(2)[None], 2, torch.tensor([0.25]), 1)
    assert torch.allclose(got, torch.tensor([[[c, s], [-s, c]]]), atol=1e-6)
    assert rotate_rows(torch.eye(2)[None], 0, torch.tensor([0.25]), 1).equal(torch.eye(2)[None])
    torch.manual_seed(2)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    b = torch.linalg.qr(torch.randn(3, 16, 5)).Q.transpose(1, 2)  # [layers, r=5, D=16] orthonormal rows
    a = torch.randn(3, 9, 5)
    want = to_rows(shift_keys(from_rows(torch.bmm(a, b), 2), -13, inv))
    rb = rotate_rows(b, -13, inv, 2)
    assert torch.allclose(torch.bmm(a, rb), want, atol=1e-5)
    assert torch.allclose(torch.bmm(rb, rb.transpose(1, 2)), torch.eye(5).expand(3, 5, 5), atol=1e-5)
    # bfloat16 factors: float32 math, rounded once into bf16; a non-contiguous B is read as it is
    half = rotate_rows(b.bfloat16(), -13, inv, 2)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, rotate_rows(b.bfloat16().float(), -13, inv, 2).bfloat16())
    assert torch.allclose(rotate_rows(b.transpose(1, 2).contiguous().transpose(1, 2), -13, inv, 2), rb, atol=1e-6)


def test_add_shift_into_sums_rotates_and_writes_in_place():
    """By hand, one head of dim 2 turned a quarter turn per position: ``[1, 2] + [0.5, -1] = [1.5, 1]``
    rotated by one position is ``[-1, 1.5]``; written into token 1 of a 3-token cache, the other rows
    untouched; without a shift the sum is written as it is; without a correction, ``x`` rotated."""
    inv = torch.tensor([math.pi / 2])
    x = torch.tensor([1.0, 2.0]).view(1, 1, 1, 2)
    corr = torch.tensor([0.5, -1.0]).view(1, 1, 2)
    cache = torch.full((1, 1, 3, 2), 7.0)
    add_shift_into(cache[:, :, 1:2], x, 1, inv, corr)
    assert torch.allclose(cache[0, 0], torch.tensor([[7.0, 7.0], [-1.0, 1.5], [7.0, 7.0]]), atol=1e-6)
    add_shift_into(cache[:, :, 0:1], x, 0, inv, corr)
    assert cache[0, 0, 0].tolist() == [1.5, 1.0]
    add_shift_into(cache[:, :, 2:3], x, 1, inv)
    assert torch.allclose(cache[0, 0, 2], torch.tensor([-2.0, 1.0]), atol=1e-6)
    # a bfloat16 destination (steps of 2^-7 above 1) gets the float32 sum rounded once:
    # 1 + 2^-8 + 2^-9 -> 1 + 2^-7, where rounding 1 + 2^-8 first (a tie, to even: 1) would give 1
    low = torch.zeros(1, 1, 1, 2, dtype=torch.bfloat16)
    tiny = torch.tensor([2.0**-9, 0.0], dtype=torch.bfloat16).view(1, 1, 2)
    add_shift_into(low, torch.tensor([1.0 + 2.0**-8, 0.0]).view(1, 1, 1, 2), 0, inv, tiny)
    assert float(low[0, 0, 0, 0]) == 1.0 + 2.0**-7


def test_operand_rows_copies_head_major_blocks_into_the_row_layout():
    """Written by hand on a 1-layer, 2-head, 3-token, head_dim-2 cache: row ``t`` is the heads of
    token ``t`` side by side, and its squared norm is taken from the cache itself."""
    x = torch.arange(12, dtype=torch.float32).view(1, 2, 3, 2)  # head 0: tokens [0,1] [2,3] [4,5]; head 1: [6,7] ...
    rows, sq = operand_rows(x[:, :, 1:3], torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and rows.is_contiguous()
    assert rows.float().tolist() == [[[2.0, 3.0, 8.0, 9.0], [4.0, 5.0, 10.0, 11.0]]]
    assert sq.dtype == torch.float32 and sq.tolist() == [158.0, 262.0]
    rows.add_(1)  # a copy: the cache is untouched
    assert float(x[0, 0, 1, 0]) == 2.0
    rows3, sq3 = operand_rows(torch.tensor([[[1.0, 2.0], [3.0, 0.0]]]), torch.float32)
    assert rows3.tolist() == [[[1.0, 2.0], [3.0, 0.0]]] and sq3.tolist() == [5.0, 9.0]


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
    from kvcmas_bench.segments import KVCache, SegmentKV

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


def test_subspace_and_gram_factorizations_give_the_same_chain(engine, monkeypatch):
    """KVCMAS at rank 4 on the tiny model's 4-agent chain (48-token question, D = 32 > 4 + 16), once
    with each factorization: the same statuses and first tokens, KV errors equal to 1e-3 relative,
    and the subspace run really factorized by subspace iteration, an entry's four stacks (K/V deltas
    and bases: every chained consumer reads its own source) in one call."""
    from kvcmas_bench.ops import lowrank

    from .test_paper_semantics import chain

    calls = []
    real = lowrank.subspace_factors

    def spy(zs, rank, *a, **kw):
        calls.append([tuple(z.shape) for z in zs])
        return real(zs, rank, *a, **kw)

    monkeypatch.setattr(lowrank, "subspace_factors", spy)
    runs = {}
    for svd in ("gram", "subspace"):
        m = get_method("kvcmas", anchors=4, rank=4, tau=1.0, svd=svd)
        for seed in (81, 82):
            chain(engine, m, rand_ids(48, seed))
        runs[svd] = chain(engine, m, rand_ids(48, 83), fidelity=True)
    assert calls and all(len(c) == 4 and all(s[1] == 48 and s[2] == 32 for s in c) for c in calls)
    statuses = [[s.status for s in r.segments] for r in runs["gram"]]
    assert statuses == [[s.status for s in r.segments] for r in runs["subspace"]]
    assert sum(st.count("corrected") for st in statuses) >= 3
    for a, b in zip(runs["gram"], runs["subspace"]):
        assert a.first_token_id == b.first_token_id
        ea, eb = a.segments[1].kv_rel_error, b.segments[1].kv_rel_error
        assert abs(ea - eb) <= 1e-3 * max(ea, 1e-6) + 1e-6
