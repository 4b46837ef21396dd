"""Pure tensor math of the delta-correction methods (KVCMAS, KVComm, GraphFlow).

Caches are handled as row matrices ``[layers, tokens, D]`` with ``D = kv_heads * head_dim``, the
``L_seg x D`` matrices of the paper, one per layer and separately for keys and values.
"""

from __future__ import annotations

import functools
import math

import torch

from .kvmath import shift_keys


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``[layers, kv_heads, S, hd]`` -> ``[layers, S, kv_heads * hd]``."""
    L, H, S, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(L, S, H * d)


def rows_copy(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh ``to_rows(x)`` in ``dtype`` (default float32) in one pass: never a view of ``x``,
    whatever its strides (corrections are added to it in place)."""
    L, H, S, d = x.shape
    out = torch.empty(L, S, H, d, dtype=dtype, device=x.device)
    out.copy_(x.permute(0, 2, 1, 3))
    return out.view(L, S, H * d)


def from_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of :func:`to_rows`."""
    L, S, D = x.shape
    return x.reshape(L, S, kv_heads, D // kv_heads).permute(0, 2, 1, 3)


def canonical_keys(k: torch.Tensor, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys rotated so the segment starts at position 0 (position-free comparison coordinates)."""
    return shift_keys(k, -start, inv_freq)


def truncated_svd(z: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 7 per layer: ``z ~ A @ B`` with ``A = U_r S_r`` (``[layers, S, r]``), ``B = R_r^T`` (``[layers, r, D]``).

    Exact (up to float error) once ``rank >= min(S, D)``. The reference decomposition: a full SVD
    of every layer.
    """
    u, s, vh = torch.linalg.svd(z.float(), full_matrices=False)
    r = min(rank, s.shape[-1])
    a = u[..., :r] * s[..., None, :r]
    return a.to(z.dtype).contiguous(), vh[..., :r, :].to(z.dtype).contiguous()


def truncated_svd_gram(z: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of :func:`truncated_svd` from the ``D x D`` Gram matrix, batched over layers.

    ``Z^T Z = R S^2 R^T``: its top-``r`` eigenvectors are the right singular vectors, so
    ``B = R_r^T`` (orthonormal rows) and ``A = Z R_r = U_r S_r``. One GEMM over the segment
    (``L S D^2``) plus an eigendecomposition of ``L`` small ``D x D`` matrices (float32) replaces a
    full SVD of every ``S x D`` layer; the truncation is exact (Eckart-Young), not randomized. Used
    when the segment is longer than ``D``; otherwise the Gram matrix is no smaller and the exact
    SVD runs. The eigendecomposition runs in float32: only the top-``r`` eigenvectors are kept, and
    their reconstruction error equals float64's to six digits (30 random 1024 x 192 layers, two
    spectra) at ~60% of its time; squaring the condition number costs accuracy only at the bottom
    of the spectrum, which is dropped.
    """
    L, S, D = z.shape
    if S <= D:
        return truncated_svd(z, rank)
    r = min(rank, D)
    zf = z.float()
    _, vecs = torch.linalg.eigh(gram_matrices(zf))  # ascending eigenvalues
    v = vecs[..., -r:].flip(-1)  # [L, D, r], largest first
    a = torch.bmm(zf, v)
    return a.to(z.dtype).contiguous(), v.transpose(1, 2).to(z.dtype).contiguous()


def _cholesky_qr(x: torch.Tensor, shift: float) -> torch.Tensor:
    """``x R^{-1}`` with ``R^T R = x^T x + shift * max(diag) I`` (batched): the same span, columns closer
    to orthonormal. The shift keeps the Cholesky factorization defined for ill-conditioned or
    all-zero ``x``; three passes with shifts 1e-5, 1e-6, 1e-6 give orthonormal columns in float32
    for condition numbers up to ~1e7 (shifted Cholesky QR3)."""
    m = torch.bmm(x.transpose(1, 2), x)
    diag = m.diagonal(dim1=1, dim2=2)
    diag.add_(shift * diag.amax(-1, keepdim=True) + torch.finfo(x.dtype).tiny)
    c = torch.linalg.cholesky_ex(m)[0]  # no host sync; the shift keeps m positive definite
    return torch.linalg.solve_triangular(c, x.transpose(1, 2), upper=False).transpose(1, 2)


def gram_matrices(z: torch.Tensor, low: torch.dtype | None = None) -> torch.Tensor:
    """``Z^T Z`` per layer of ``z`` (``[layers, S, D]``), ``[layers, D, D]`` float32. With ``low =
    torch.bfloat16``, the Gram matrix of ``z`` rounded to bfloat16, accumulated in float32: on a GPU one
    tensor-core GEMM (``out_dtype``); elsewhere the same numbers from the rounded rows in float32
    (products of two bfloat16 values are exact in float32)."""
    if low is not torch.bfloat16:
        zf = z.float()
        return torch.bmm(zf.transpose(1, 2), zf)
    zl = z.to(low)
    if z.device.type == "cuda":
        return torch.bmm(zl.transpose(1, 2), zl, out_dtype=torch.float32)
    zl = zl.float()
    return torch.bmm(zl.transpose(1, 2), zl)


@functools.lru_cache(maxsize=4)
def _subspace_start(L: int, D: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """The seeded Gaussian start ``[L, D, k]`` (drawn on the CPU: the same on every device) on
    ``device``, cached (a pageable host-to-device copy per factorization cost 0.4 ms on an H200; one
    entry is 6 MiB on an 8B model's shape). Never modified in place by the iteration."""
    return torch.randn(L, D, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(device)


def _orthonormalizer(m: torch.Tensor) -> torch.Tensor:
    """``P`` (``[n, k, k]``, float64) such that ``X P`` has orthonormal columns, from ``m = X^T X``:
    ``R^{-1}`` of its Cholesky factor where ``X`` is well conditioned (after the iteration's QR3 every
    healthy layer's ``X`` is orthonormal to float32 precision, so the factor's diagonal is ~1), else
    (an all-zero or rank-deficient layer) the eigenvectors of ``m`` scaled by ``lam^-1/2`` with the
    directions below ``1e-7`` of the largest dropped (zero columns). Why not the eigenvectors
    everywhere: a host ``eigh`` of 128 such 48 x 48 matrices (four stacks of 32 layers) takes ~20 ms,
    a Cholesky factorization well under one."""
    c, info = torch.linalg.cholesky_ex(m)
    d = c.diagonal(dim1=1, dim2=2)
    ok = (info == 0) & (d.amin(-1) > 0.5 * d.amax(-1))
    eye = torch.eye(m.shape[-1], dtype=m.dtype).expand_as(m)
    p = torch.linalg.solve_triangular(torch.where(ok[:, None, None], c, eye).transpose(1, 2), eye, upper=True)
    if not bool(ok.all()):
        lam, u = torch.linalg.eigh(m[~ok])
        keep = lam > 1e-7 * lam[:, -1:].clamp_min(torch.finfo(torch.float64).tiny)
        p[~ok] = u * torch.where(keep, lam.clamp_min(1e-300).rsqrt(), torch.zeros_like(lam))[:, None, :]
    return p


def truncated_svd_subspace(
    z: torch.Tensor,
    rank: int,
    oversample: int = 16,
    iters: int = 8,
    seed: int = 0,
    gram_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of :func:`truncated_svd_gram` by subspace iteration on the Gram matrix: GEMMs only.

    ``X <- orth(G X)`` ``iters + 1`` times from a seeded Gaussian ``[D, r + oversample]`` start (the
    same start on every device), then Rayleigh-Ritz: the top-``r`` eigenvectors of the ``k x k``
    matrix ``X^T G X`` (in float64 on the host; its eigenvalue problem is tiny). ``G`` is scaled to a
    unit largest diagonal entry per layer first (the same eigenvectors; no overflow in the squares).
    Orthonormalization in the loop is a shifted Cholesky QR3 (GEMMs and ``k x k`` Cholesky factors);
    the last one is exact, through the eigenvectors of ``X^T X``, dropping directions below float32
    precision, so a rank-deficient layer (an all-zero delta) gives exact zero columns. A layer with a
    NaN/inf gives NaN factors (as the Gram path does), so the correction's non-finite check falls back
    to dense prefill. An approximation of the exact truncated SVD: the error in the captured subspace
    shrinks like ``(s_{k+1} / s_r)^(2 iters)``; on SmolLM2's 4K-token K/V deltas and bases its rank-32
    reconstruction error equals the exact one to 6e-6 relative (``benchmarks/delta_correction.py``
    prints both). Why: on a GPU, a batched ``eigh`` of ``L`` matrices of ``D x D`` is latency-bound
    (H200, 32 of 1024 x 1024: 0.336 s, 2.4x a dense 4K-token prefill of an 8B model), while these
    GEMMs take milliseconds. Falls back to the exact Gram factorization when ``r + oversample >= D``.
    ``gram_dtype``: see :func:`gram_matrices` (``A = Z V`` stays float32). One stack of
    :func:`subspace_factors`.
    """
    return subspace_factors([z], rank, oversample, iters, seed, gram_dtype)[0]


#: extra columns of the subspace iteration beyond the rank; where ``rank + oversample`` reaches the
#: row width it would span everything, so :func:`subspace_factors` runs the exact Gram factorization
SUBSPACE_OVERSAMPLE = 16


def subspace_factors(
    zs: list[torch.Tensor],
    rank: int,
    oversample: int = SUBSPACE_OVERSAMPLE,
    iters: int = 8,
    seed: int = 0,
    gram_dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`truncated_svd_subspace` of several ``[layers, S_i, D]`` stacks (same ``layers``, ``D`` and
    device; an anchor entry's K/V deltas and bases) in one iteration: their Gram matrices side by side
    in one batch, each with the same seeded start as alone, so every stack gets the factors of its
    own call (the batched GEMMs and the host's eigenproblems are per matrix) with a quarter of the
    kernel launches for four. Why: on an H200 the iteration's small kernels were launch-bound (four
    separate factorizations of the 8B shape: 118 ms of host time under the profiler for 44 ms of device
    work)."""
    L, _, D = zs[0].shape
    r = min(rank, D)
    k = r + oversample
    if k >= D:
        return [truncated_svd_gram(z, rank) for z in zs]
    n = len(zs)
    g = torch.cat([gram_matrices(z, gram_dtype) for z in zs]) if n > 1 else gram_matrices(zs[0], gram_dtype)
    bad = ~torch.isfinite(g).flatten(1).all(1)
    scale = g.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    g = torch.where(bad[:, None, None], 0.0, g / torch.where(bad, 1.0, scale)[:, None, None])
    x = _subspace_start(L, D, k, seed, g.device)
    x = x.repeat(n, 1, 1) if n > 1 else x
    for _ in range(iters + 1):
        x = _cholesky_qr(_cholesky_qr(_cholesky_qr(torch.bmm(g, x), 1e-5), 1e-6), 1e-6)
    gx = torch.bmm(g, x)
    small = torch.stack([torch.bmm(x.transpose(1, 2), x), torch.bmm(x.transpose(1, 2), gx)]).cpu().double()
    p = _orthonormalizer(small[0])
    _, w = torch.linalg.eigh(p.transpose(1, 2) @ small[1] @ p)
    v = torch.bmm(x, (p @ w[..., -r:].flip(-1)).float().to(g.device))  # [n L, D, r], largest first
    v = torch.where(bad[:, None, None], torch.nan, v)
    out = []
    for i, z in enumerate(zs):
        vi = v[i * L : (i + 1) * L]
        a = torch.bmm(z.float(), vi)
        out.append((a.to(z.dtype).contiguous(), vi.transpose(1, 2).to(z.dtype).contiguous()))
    return out


#: the anchor factorizations by name ("auto" picks one per device: :func:`factorize`)
FACTORIZATIONS = ("auto", "gram", "exact", "subspace")


def factorization(svd: str, device: torch.device, rank: int | None = None, width: int | None = None) -> str:
    """The factorization ``svd`` names on ``device``. "auto": the exact Gram factorization on the CPU,
    the subspace iteration elsewhere (where ``eigh`` is latency-bound). Given the ``rank`` and the
    K/V row ``width`` (kv_heads x head_dim), "gram" where the subspace iteration would fall back to it
    (``min(rank, width) + SUBSPACE_OVERSAMPLE >= width``: narrow rows, tiny models)."""
    how = ("gram" if device.type == "cpu" else "subspace") if svd == "auto" else svd
    if how == "subspace" and rank is not None and width is not None and min(rank, width) + SUBSPACE_OVERSAMPLE >= width:
        return "gram"
    return how


def factorize(
    z: torch.Tensor, rank: int, svd: str = "auto", gram_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors ``A, B`` of every layer of ``z`` by the named method (:func:`factorization`)."""
    return factorize_many([z], rank, svd, gram_dtype)[0]


def factorize_many(
    zs: list[torch.Tensor], rank: int, svd: str = "auto", gram_dtype: torch.dtype | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`factorize` of every stack of ``zs`` (same layers, ``D`` and device). The subspace iteration
    runs once for all of them (:func:`subspace_factors`), its Gram matrices from ``gram_dtype``-rounded
    rows when that is bfloat16 (the anchors' storage dtype: the rounding moves the rank-32 error of
    SmolLM2's 2K-token deltas and bases by <= 3e-6 relative, less than storing the factors in bfloat16
    does, 1-3e-5); the exact Gram and SVD paths factorize each stack alone, in float32."""
    how = factorization(svd, zs[0].device)
    if how == "subspace":
        return subspace_factors(zs, rank, gram_dtype=gram_dtype)
    fn = truncated_svd_gram if how == "gram" else truncated_svd
    return [fn(z, rank) for z in zs]


def rope_shift_halves(inv_freq: torch.Tensor, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (``[head_dim // 2]``, float32) of the rotation by ``delta`` positions."""
    ang = float(delta) * inv_freq.to(torch.float32)
    return ang.cos(), ang.sin()


def rotate_into(out: torch.Tensor, x: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``out <- x`` rotated by ``delta`` positions along the last dim (``hd``; HF's rotate_half
    convention), in float32, in three passes: ``x * [c, c]`` at full width, then each half's
    ``-/+ s * other half`` added in place. ``out``: float32, ``x``'s shape, any strides, not
    overlapping ``x``; ``x`` any float dtype (promoted, exactly, to float32)."""
    h = x.shape[-1] // 2
    c, s = (t.to(x.device) for t in rope_shift_halves(inv_freq, delta))
    torch.mul(x, torch.cat([c, c]), out=out)
    out[..., :h].addcmul_(x[..., h:], s, value=-1.0)
    out[..., h:].addcmul_(x[..., :h], s)
    return out


def shift_to_rows(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``to_rows(shift_keys(keys, delta))``: the rotated keys in the row layout ``[layers, S,
    kv_heads * hd]`` (float32), in three passes: ``keys * [c, c]`` gathered from the head-major
    layout into the output at full width, then each half's ``-/+ s * other half`` added in place
    (4x faster per 256-token block on an AMX Xeon than copying into the row layout first and
    rotating there with four half-width ops, whose first one ran into a fresh buffer)."""
    L, H, S, hd = keys.shape
    out = torch.empty(L, S, H, hd, dtype=torch.float32, device=keys.device)
    return rotate_into(out, keys.permute(0, 2, 1, 3), delta, inv_freq).view(L, S, H * hd)


def rotate_rows(rows: torch.Tensor, delta: int, inv_freq: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Row-layout keys (``[layers, R, kv_heads * hd]``, e.g. the ``B`` factors of key anchors) rotated by
    ``delta`` positions, in their dtype (float32 math). For a low-rank key factor ``A B`` in coordinates
    ``p``, ``A rotate_rows(B, d)`` is the same factor in coordinates ``p + d``: the rotation is a
    block-diagonal orthogonal map on each row, so it moves onto the ``R`` rows of ``B`` (orthonormal
    rows stay orthonormal) instead of the ``S`` rows of the segment. Rotated in the row layout itself
    (each row viewed as ``[kv_heads, hd]``, no head-major permute): three passes, 2-2.5x faster than
    rotating the permuted ``from_rows`` view (10 rank-32 bf16/fp32 factors, 30 layers, D = 192)."""
    if delta == 0:
        return rows
    L, R, D = rows.shape
    x = rows.reshape(L, R, kv_heads, D // kv_heads).float()
    out = torch.empty(x.shape, dtype=torch.float32, device=rows.device)
    return rotate_into(out, x, delta, inv_freq).view(L, R, D).to(rows.dtype)


def operand_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operand of the distances from a block of rows: ``to_rows(x)`` in ``dtype`` (one copy
    from a head-major ``[layers, kv_heads, t, hd]`` block; row-layout ``[layers, t, D]`` blocks are
    converted as they are) and its squared norm per token summed over layers (float32, ``[t]``, taken
    from ``x`` itself, not from the converted copy)."""
    if x.dim() == 3:
        return x.to(dtype), token_sqnorms(x.float())
    xf = x if x.dtype == torch.float32 else x.float()
    return rows_copy(x, dtype), torch.linalg.vecdot(xf, xf).sum(dim=(0, 1))


def add_shift_into(
    dst: torch.Tensor, x: torch.Tensor, delta: int, inv_freq: torch.Tensor, corr: torch.Tensor | None = None
) -> torch.Tensor:
    """``dst <- shift_keys(x + from_rows(corr), delta)``: head-major ``x`` (``[layers, kv_heads, t, hd]``)
    plus an optional row-layout correction (``[layers, t, kv_heads * hd]``, any float dtype), rotated by
    ``delta`` positions (0: none, e.g. values) and written into ``dst`` (same shape as ``x``, any
    strides). The sum and the rotation run in float32; the result is rounded once, into ``dst``'s dtype."""
    L, H, t, hd = x.shape
    if delta == 0:
        return dst.copy_(x) if corr is None else torch.add(x, from_rows(corr, H), out=dst)
    if corr is None:
        s = x
    else:
        s = torch.empty(L, H, t, hd, dtype=torch.float32, device=x.device)
        torch.add(x, from_rows(corr, H), out=s)
    direct = dst.dtype == torch.float32
    out = dst if direct else torch.empty(L, H, t, hd, dtype=torch.float32, device=x.device)
    rotate_into(out, s, delta, inv_freq)
    return dst if direct else dst.copy_(out)


def lowrank_sqdist(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_layers ||x - a @ b||_F^2`` without forming ``a @ b``.

    Uses ``||X - AB||^2 = ||X||^2 - 2 <X B^T, A> + tr((A^T A)(B B^T))``; x is ``[layers, k, D]``,
    a ``[layers, k, r]``, b ``[layers, r, D]``.
    """
    x, a, b = x.float(), a.float(), b.float()
    cross = (torch.bmm(x, b.transpose(1, 2)) * a).sum()
    gram = (torch.bmm(a.transpose(1, 2), a) * torch.bmm(b, b.transpose(1, 2))).sum()
    return (x.square().sum() - 2 * cross + gram).clamp_min(0.0)


def gate_entropy(d: torch.Tensor, temperature: float = 1.0) -> tuple[float, torch.Tensor]:
    """Eq. 10-11: ``g = softmax(-d / T)``, normalized entropy ``-sum g log2 g / log2 |A|``."""
    g = torch.softmax(-d.double() / temperature, dim=0)
    n = g.numel()
    if n < 2:
        return 0.0, g.float()
    h = -(g * torch.log2(g.clamp_min(1e-300))).sum() / math.log2(n)
    return float(h), g.float()


def token_weights(dist: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Token-wise interpolation weights: ``softmax_v(-dist[v, t] / T)`` over anchors, ``[n, k]``."""
    return torch.softmax(-dist.float() / temperature, dim=0)


def prune_weights(w: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (anchor, token) weights of ``w`` (``[n, k]``) take part in the correction: those
    ``>= tol`` (each token keeps at least its largest weight). Returns the keep mask ``[n, k]`` and
    the dropped weight mass per token ``[k]`` (a sum of weights each ``< tol``). ``tol = 0`` keeps all."""
    if tol <= 0 or w.numel() == 0:
        return torch.ones_like(w, dtype=torch.bool), w.new_zeros(w.shape[1])
    keep = w >= tol
    keep.scatter_(0, w.argmax(dim=0, keepdim=True), True)
    return keep, torch.where(keep, 0.0, w).sum(dim=0)


def sparse_apply(w: torch.Tensor, keep: torch.Tensor, a_list: list, b_list: list) -> torch.Tensor:
    """``sum_v w[v, t] (A_v B_v)[l, t]`` over the kept (anchor, token) pairs only, ``[layers, k, D]``
    float32: per anchor one GEMM over its kept tokens' ``A`` rows (scaled by their weights), added
    into their output rows. ``b_list[v]`` is None for full-dimensional anchors (``a`` is the matrix).
    Its cost follows the kept pairs, not ``n x k``."""
    n, k = w.shape
    L = a_list[0].shape[0]
    D = a_list[0].shape[-1] if b_list[0] is None else b_list[0].shape[-1]
    out = torch.zeros(L, k, D, dtype=torch.float32, device=w.device)
    for v in range(n):
        idx = keep[v].nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        a, b = a_list[v], b_list[v]
        dt = a.dtype if b is None else b.dtype
        if idx.numel() == k:
            rows = a[:, :k] * w[v][None, :, None].to(dt)
            out += (rows if b is None else torch.bmm(rows, b)).float()
            continue
        rows = a[:, idx] * w[v, idx][None, :, None].to(dt)
        out.index_add_(1, idx, (rows if b is None else torch.bmm(rows, b)).float())
    return out


def effective_rank(z: torch.Tensor, energy: float = 0.9) -> float:
    """Mean over layers of the smallest rank keeping ``energy`` of the squared singular values
    (per layer: :func:`kvcmas_bench.ops.spectrum.effective_ranks`)."""
    from .spectrum import effective_ranks

    return float(effective_ranks(z, energy).double().mean())


def token_sqnorms(x: torch.Tensor) -> torch.Tensor:
    """``sum_layers ||x[l, t]||^2`` per token of a float ``[layers, k, D]`` (``[k]``): one dot
    product per row, several times faster on CPU than a norm over the non-adjacent dims (0, 2)."""
    return torch.linalg.vecdot(x, x).sum(dim=0)


def row_sqnorms(a: torch.Tensor) -> torch.Tensor:
    """``sum_layers ||a[l, t]||^2`` per row ``t`` of a ``[layers, S, r]`` factor (float32, ``[S]``)."""
    return a.float().square().sum(dim=(0, 2))


def lowrank_token_sqdist(
    x: torch.Tensor, x_sq: torch.Tensor, a_list: list, a_sq: list, b_t: torch.Tensor, ranks: list[int]
) -> torch.Tensor:
    """``[n, k]``: ``sum_layers ||x_t - (A_v B_v)_t||^2`` for every token of ``x`` and anchor ``v``.

    ``||x_t - a_t B||^2 = ||x_t||^2 - 2 a_t . (B x_t) + ||a_t||^2`` (``B`` has orthonormal rows),
    with every anchor's ``B^T`` side by side in ``b_t`` (``[layers, D, sum r_v]``, contiguous: the GEMM
    runs ~10% faster on it than on a transposed view): one GEMM ``x B_all^T`` in the factors' dtype,
    then per anchor one product-sum with its own ``A`` rows (no stacked copy of the ``A`` factors),
    summed over the rank first (contiguous, float32) and the layers second. ``x``: ``[layers, k, D]``;
    ``x_sq``: ``[k]`` (summed over layers); ``a_list[v]``: ``[layers, >= k, r_v]``; ``a_sq[v]``:
    ``[>= k]`` row norms.
    """
    k = x.shape[1]
    y = torch.bmm(x.to(b_t.dtype), b_t)
    out = torch.empty(len(a_list), k, dtype=torch.float32, device=x.device)
    off = 0
    for v, (a, r) in enumerate(zip(a_list, ranks)):
        cross = torch.mul(a[:, :k], y[:, :, off : off + r]).sum(dim=2, dtype=torch.float32).sum(dim=0)
        out[v] = x_sq - 2.0 * cross + a_sq[v][:k]
        off += r
    return out.clamp_min_(0.0)


def lowrank_apply(w: torch.Tensor, a_list: list, b_all: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    """``sum_v w[v, t] * (A_v B_v)[l, t]``, ``[layers, k, D]``: every anchor's ``A`` rows scaled by its
    token weights straight into one ``[layers, k, sum r_v]`` buffer, then one GEMM with ``b_all``."""
    n, k = w.shape
    L = b_all.shape[0]
    aw = torch.empty(L, k, b_all.shape[1], dtype=b_all.dtype, device=b_all.device)
    wd = w.to(b_all.dtype)[:, None, :, None]
    off = 0
    for v, (a, r) in enumerate(zip(a_list, ranks)):
        torch.mul(a[:, :k], wd[v], out=aw[:, :, off : off + r])
        off += r
    return torch.bmm(aw, b_all)
