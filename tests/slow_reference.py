"""The delta correction as it was before the speed work (issue 13), kept as the slow reference the
optimized path is tested against: every anchor's factors zero-padded and stacked per call, the
per-token distances from the stacked GEMM, the weighted sum as one GEMM over stacked factors."""

from __future__ import annotations

import torch

from kvcmas_bench.ops.kvmath import shift_keys


def to_rows(x: torch.Tensor) -> torch.Tensor:
    L, H, S, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(L, S, H * d)


def from_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    L, S, D = x.shape
    return x.reshape(L, S, kv_heads, D // kv_heads).permute(0, 2, 1, 3)


def stack_factors(factors: list, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[n, L, k, r]`` and B ``[n, L, r, D]`` of the first ``k`` rows, zero-padded to the largest rank."""
    r = max(f.a.shape[-1] for f in factors)
    a = torch.stack([torch.nn.functional.pad(f.a[:, :k], (0, r - f.a.shape[-1])) for f in factors])
    b = torch.stack([torch.nn.functional.pad(f.b, (0, 0, 0, r - f.b.shape[-2])) for f in factors])
    return a, b


def token_sqdist(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, orthonormal: bool = True) -> torch.Tensor:
    """``[n, k]`` squared distance of every token to each low-rank anchor, summed over layers."""
    n, L, k, r = a.shape
    bcat = b.permute(1, 0, 2, 3).reshape(L, n * r, b.shape[-1])
    xb = torch.bmm(x.to(b.dtype), bcat.transpose(1, 2)).float()
    x = x.float()
    acat = a.float().permute(1, 2, 0, 3).reshape(L, k, n * r)
    if orthonormal:
        quad_cross = (acat * (acat - 2 * xb)).view(L, k, n, r).sum(-1)
    else:
        gram = torch.matmul(b.float(), b.float().transpose(-1, -2))
        quad = (torch.matmul(a.float(), gram) * a.float()).sum(-1).permute(1, 2, 0)
        quad_cross = quad - 2 * (acat * xb).view(L, k, n, r).sum(-1)
    return (x.square().sum(-1)[..., None] + quad_cross).sum(0).T.clamp_min(0.0)


def weighted_lowrank(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_v w[v, t] * (A_v @ B_v)[l, t]`` as one batched GEMM over stacked factors."""
    n, L, k, r = a.shape
    aw = (a * w[:, None, :, None].to(a.dtype)).permute(1, 2, 0, 3).reshape(L, k, n * r)
    bs = b.permute(1, 0, 2, 3).reshape(L, n * r, b.shape[-1])
    return torch.bmm(aw, bs).float()


def _distance(x: torch.Tensor, bases: list) -> torch.Tensor:
    k = x.shape[1]
    if all(b.b is not None for b in bases):
        return (token_sqdist(x, *stack_factors(bases, k)) / (x.shape[0] * x.shape[2])).sqrt()
    return torch.stack([(x.float() - b.rows(k).float()).abs().mean(dim=(0, 2)) for b in bases])


def reference_correction(
    src, anchors: list, consumer: str, start: int, inv_freq, heads: int, k: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``align(C_src) + sum_v w_v Delta_v`` on the first ``k`` rows (keys, values) at ``start``."""
    ref_k = to_rows(shift_keys(src.k, -src.start, inv_freq))
    ref_v = to_rows(src.v)
    out_k, out_v = ref_k.clone(), ref_v.clone()
    for part, rows, out in (("k", ref_k, out_k), ("v", ref_v, out_v)):
        bases = [a.factor("base_k" if part == "k" else "base_v", consumer) for a in anchors]
        deltas = [a.factor("delta_k" if part == "k" else "delta_v", consumer) for a in anchors]
        w = torch.softmax(-_distance(rows[:, :k], bases).float() / temperature, dim=0)
        if all(d.b is not None for d in deltas):
            corr = weighted_lowrank(w, *stack_factors(deltas, k))
        else:
            corr = sum(w[i][None, :, None].to(out.dtype) * d.rows(k) for i, d in enumerate(deltas))
        out[:, :k] += corr.to(out.dtype)
    return shift_keys(from_rows(out_k, heads), start, inv_freq), from_rows(out_v, heads)
