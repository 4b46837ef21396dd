"""Singular-value spectra of per-layer cache matrices: effective rank and truncation error.

A cache (or a delta) is handled per layer as an ``S x D`` matrix (``[layers, S, D]``, keys and values
apart). The **effective rank** is the minimum rank keeping ``energy`` (0.9 in the paper) of the
squared singular values; the **relative reconstruction error** of the best rank-r approximation is
``||Z - Z_r||_F / ||Z||_F = sqrt(sum_{i > r} s_i^2 / sum_i s_i^2)`` (Eckart-Young).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def singular_values(z: torch.Tensor) -> torch.Tensor:
    """``[layers, min(S, D)]`` singular values of every layer's matrix (float64 for the energy sums)."""
    return torch.linalg.svdvals(z.double())


def effective_ranks_from(s: torch.Tensor, energy: float = 0.9) -> torch.Tensor:
    """Minimum rank keeping ``energy`` of ``sum s^2``, per row of singular values ``[..., n]``;
    0 where the matrix is zero."""
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must lie in (0, 1], got {energy}")
    e2 = s.square()
    total = e2.sum(-1, keepdim=True)
    frac = e2.cumsum(-1) / total.clamp_min(1e-300)
    r = (frac < energy - 1e-12).sum(-1) + 1
    return torch.where(total[..., 0] > 0, r, torch.zeros_like(r))


def effective_ranks(z: torch.Tensor, energy: float = 0.9) -> torch.Tensor:
    """Effective rank of each layer of ``z`` (``[layers, S, D]``), as a ``[layers]`` integer tensor."""
    return effective_ranks_from(singular_values(z), energy)


def truncation_errors_from(s: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Relative Frobenius error of the best rank-r approximation for each r in ``ranks``:
    ``[..., len(ranks)]``; 0 where the matrix is zero or r reaches its rank."""
    e2 = s.square()
    total = e2.sum(-1, keepdim=True)
    tail = total - torch.cat([torch.zeros_like(total), e2.cumsum(-1)], -1)  # tail[i]: energy beyond rank i
    idx = torch.as_tensor([min(int(r), s.shape[-1]) for r in ranks], device=s.device)
    kept = tail.index_select(-1, idx).clamp_min(0.0)
    return torch.where(total > 0, (kept / total.clamp_min(1e-300)).sqrt(), torch.zeros_like(kept))
