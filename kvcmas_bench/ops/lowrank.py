"""Pure tensor math of the delta-correction methods (KVCMAS, KVComm, GraphFlow).

Caches are handled as row matrices ``[layers, tokens, D]`` with ``D = kv_heads * head_dim``, the
``L_seg x D`` matrices of the paper, one per layer and separately for keys and values.
"""

from __future__ import annotations

import math

import torch

from .kvmath import shift_keys


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``[layers, kv_heads, S, hd]`` -> ``[layers, S, kv_heads * hd]``."""
    L, H, S, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(L, S, H * d)


def from_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of :func:`to_rows`."""
    L, S, D = x.shape
    return x.reshape(L, S, kv_heads, D // kv_heads).permute(0, 2, 1, 3)


def canonical_keys(k: torch.Tensor, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys rotated so the segment starts at position 0 (position-free comparison coordinates)."""
    return shift_keys(k, -start, inv_freq)


def truncated_svd(z: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 7 per layer: ``z ~ A @ B`` with ``A = U_r S_r`` (``[layers, S, r]``), ``B = R_r^T`` (``[layers, r, D]``).

    Exact (up to float error) once ``rank >= min(S, D)``.
    """
    u, s, vh = torch.linalg.svd(z.float(), full_matrices=False)
    r = min(rank, s.shape[-1])
    a = u[..., :r] * s[..., None, :r]
    return a.to(z.dtype).contiguous(), vh[..., :r, :].to(z.dtype).contiguous()


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


def weighted_lowrank(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_v w[v, t] * (A_v @ B_v)[l, t]`` as one batched GEMM over stacked factors.

    w ``[n, k]``, a ``[n, layers, k, r]``, b ``[n, layers, r, D]`` -> ``[layers, k, D]``.
    """
    n, L, k, r = a.shape
    aw = (a * w[:, None, :, None].to(a.dtype)).permute(1, 2, 0, 3).reshape(L, k, n * r)
    bs = b.permute(1, 0, 2, 3).reshape(L, n * r, b.shape[-1])
    return torch.bmm(aw, bs).float()


def effective_rank(z: torch.Tensor, energy: float = 0.9) -> float:
    """Mean over layers of the smallest rank keeping ``energy`` of the squared singular values
    (per layer: :func:`kvcmas_bench.ops.spectrum.effective_ranks`)."""
    from .spectrum import effective_ranks

    return float(effective_ranks(z, energy).double().mean())


def token_sqdist(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, orthonormal: bool = True) -> torch.Tensor:
    """Per-token squared distance to each low-rank anchor, summed over layers: ``[n, k]``.

    ``||x_t - a_t B||^2 = ||x_t||^2 - 2 <x_t B^T, a_t> + a_t (B B^T) a_t^T`` for every layer, with
    all anchors' B stacked into one GEMM. The factors of :func:`truncated_svd` have orthonormal rows
    (``B B^T = I``), so the last term is ``||a_t||^2``. x ``[layers, k, D]``, a ``[n, layers, k, r]``,
    b ``[n, layers, r, D]``. Summing over tokens gives the gate distance of Eq. 9 squared.
    """
    n, L, k, r = a.shape
    bcat = b.permute(1, 0, 2, 3).reshape(L, n * r, b.shape[-1])
    xb = torch.bmm(x.to(b.dtype), bcat.transpose(1, 2)).float()  # the GEMM runs in the factors' dtype
    x = x.float()
    acat = a.float().permute(1, 2, 0, 3).reshape(L, k, n * r)
    if orthonormal:
        quad_cross = (acat * (acat - 2 * xb)).view(L, k, n, r).sum(-1)
    else:
        gram = torch.matmul(b.float(), b.float().transpose(-1, -2))
        quad = (torch.matmul(a.float(), gram) * a.float()).sum(-1).permute(1, 2, 0)
        quad_cross = quad - 2 * (acat * xb).view(L, k, n, r).sum(-1)
    return (x.square().sum(-1)[..., None] + quad_cross).sum(0).T.clamp_min(0.0)
