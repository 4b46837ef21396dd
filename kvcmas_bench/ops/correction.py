"""The blockwise delta correction's pieces (Eq. 8): block ranges, which weighted terms to apply, the
full-dimensional weighted sum, and the figures a correction tallies on the device and reads once.

:meth:`~kvcmas_bench.methods.delta.OnlineDeltaCorrection.correct` composes them block by block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .lowrank import prune_weights


def block_ranges(k: int, size: int) -> list[tuple[int, int]]:
    """``(start, n)`` of the consecutive blocks of at most ``size`` rows (at least 1) covering ``k`` rows."""
    size = max(1, size)
    return [(s, min(size, k - s)) for s in range(0, k, size)]


def select_terms(w: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Which (anchor, token) terms of the weights ``w`` (``[n, t]``) a block applies, and how.

    The terms :func:`~kvcmas_bench.ops.lowrank.prune_weights` keeps at ``tol``; when they are more than
    half of all, pruning saves little: every term is applied by the one stacked GEMM (``stacked``
    True, the keep mask all True, no weight dropped). Returns ``(keep, dropped mass per token, stacked)``.
    """
    keep, mass = prune_weights(w, tol)
    if float(keep.float().mean()) > 0.5:
        return torch.ones_like(keep), mass.zero_(), True
    return keep, mass, False


def weighted_rows(w: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """``sum_v w[v, t] rows_v[l, t]`` in float32, ``[layers, t, D]``: the weighted deltas of
    full-dimensional anchors (``rows``: each anchor's rows of the block)."""
    return sum(w[i][None, :, None] * r.float() for i, r in enumerate(rows))


@dataclass(frozen=True)
class CorrectionTally:
    """What a correction tallies over its blocks, kept on the device (no host read per block): the
    applied terms of K and of V, the largest dropped weight mass of a token, and whether every
    correction was finite."""

    kept_k: torch.Tensor
    kept_v: torch.Tensor
    dropped: torch.Tensor
    finite: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device | str | None = None) -> CorrectionTally:
        z = lambda: torch.zeros((), device=device)  # noqa: E731
        return cls(z(), z(), z(), torch.ones((), dtype=torch.bool, device=device))

    def add(self, part: str, corr: torch.Tensor, keep: torch.Tensor, mass: torch.Tensor) -> CorrectionTally:
        """The tally with one block of ``part`` ("k" or "v") added: its correction ``corr`` (a NaN/inf
        anywhere reaches its sum), keep mask and dropped mass per token."""
        finite = self.finite & torch.isfinite(corr.sum())
        kept = {"k": self.kept_k, "v": self.kept_v}
        kept[part] = kept[part] + keep.float().sum()
        dropped = torch.maximum(self.dropped, mass.max().float()) if mass.numel() else self.dropped
        return CorrectionTally(kept["k"], kept["v"], dropped, finite)

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[bool, float, float, float]:
        """``(bad, kept K terms, kept V terms, largest dropped mass)`` in one host read. ``reduce`` sums
        the non-finite flag over tensor-parallel ranks (a NaN/inf on any rank's heads: every rank is bad)."""
        bad = (~self.finite).float()
        if reduce is not None:
            bad = reduce(bad)
        bad, kept_k, kept_v, dropped = torch.stack([bad, self.kept_k, self.kept_v, self.dropped]).tolist()
        return bool(bad), kept_k, kept_v, dropped


def applied_figures(kept_k: float, kept_v: float, dropped: float, k: int) -> dict:
    """A correction's accounting: anchors applied per token over the ``k`` corrected rows (mean, K then
    V, 3 decimals) and the largest dropped weight mass (6 significant digits)."""
    return {"anchors_applied": [round(kept_k / k, 3), round(kept_v / k, 3)], "dropped_weight": float(f"{dropped:.6g}")}
