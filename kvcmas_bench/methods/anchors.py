"""Online anchor pools shared by KVComm (full-dimensional) and KVCMAS (low-rank).

One pool per shared slot, process-wide. An anchor stores a base cache (keys in canonical, position-0
coordinates; values as they are) and, per consuming node, the observed correction Delta. Storage is
either the full ``[layers, S, D]`` matrices or truncated-SVD factors per layer, separately for K and
V. When the pool is full, the least frequently used anchor among the five oldest is evicted.

For the correction's GEMMs the small ``B`` factors of the anchors in use are stacked per call
(:func:`stack_b`); the large ``A`` factors are never copied into a stack (the distance and apply
kernels read them in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.lowrank import row_sqnorms, truncated_svd, truncated_svd_gram

PARTS = ("base_k", "base_v", "delta_k", "delta_v")


@dataclass(eq=False)
class Factor:
    """One ``[layers, S, D]`` matrix stack, stored full (``b is None``) or as ``a @ b``; low-rank
    factors keep their row norms ``sq`` (``[S]``, summed over layers) for the distance kernel."""

    a: torch.Tensor
    b: torch.Tensor | None = None
    sq: torch.Tensor | None = None

    @classmethod
    def make(cls, z: torch.Tensor, rank: int | None, dtype: torch.dtype | None = None, svd: str = "gram") -> Factor:
        """Full copy (``rank=None``) or rank-``rank`` SVD factors (``svd``: "gram" or "exact"), in ``dtype``."""
        dtype = dtype or z.dtype
        if rank is None:
            return cls(z.to(dtype, copy=True))
        a, b = (truncated_svd_gram if svd == "gram" else truncated_svd)(z, rank)
        a = a.to(dtype)
        return cls(a, b.to(dtype), row_sqnorms(a))

    @property
    def length(self) -> int:
        return self.a.shape[1]

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    @property
    def nbytes(self) -> int:
        n = self.a.numel() * self.a.element_size()
        return n + (0 if self.b is None else self.b.numel() * self.b.element_size())

    def rows(self, k: int) -> torch.Tensor:
        """Reconstruction of the first ``k`` rows, ``[layers, k, D]``."""
        return self.a[:, :k] if self.b is None else torch.bmm(self.a[:, :k], self.b)


@dataclass(eq=False)
class Anchor:
    base_k: Factor
    base_v: Factor
    source_key: tuple
    created: int
    deltas: dict[str, tuple[Factor, Factor]] = field(default_factory=dict)
    count: int = 0

    @property
    def length(self) -> int:
        return self.base_k.length

    @property
    def nbytes(self) -> int:
        n = self.base_k.nbytes + self.base_v.nbytes
        return n + sum(dk.nbytes + dv.nbytes for dk, dv in self.deltas.values())

    def factor(self, part: str, consumer: str) -> Factor:
        """``base_k``, ``base_v``, or the consumer's ``delta_k`` / ``delta_v``."""
        if part == "base_k":
            return self.base_k
        if part == "base_v":
            return self.base_v
        return self.deltas[consumer][0 if part == "delta_k" else 1]


def stack_b(anchors: list[Anchor], consumer: str, part: str) -> torch.Tensor:
    """The low-rank ``B`` factors of ``part`` of ``anchors`` side by side: ``[layers, sum r_v, D]``
    in the order of ``anchors``.

    Built per correction, not kept: ``B`` is ``[layers, r, D]`` per anchor (a few MB for a full pool,
    milliseconds to copy) and a persistent stack per consumer would duplicate it in the method's state
    (for short segments ``B`` is larger than ``A``)."""
    return torch.cat([a.factor(part, consumer).b for a in anchors], dim=1)


@dataclass
class AnchorPool:
    capacity: int
    anchors: list[Anchor] = field(default_factory=list)
    inserted: int = 0
    evicted: int = 0

    def compatible(self, consumer: str, k: int) -> list[Anchor]:
        """Anchors with a correction for ``consumer`` whose stored length is at least ``k``."""
        return [a for a in self.anchors if consumer in a.deltas and a.length >= k]

    def lengths(self, consumer: str) -> list[int]:
        return sorted((a.length for a in self.anchors if consumer in a.deltas), reverse=True)

    def add(
        self,
        source_key: tuple,
        base_k: torch.Tensor,
        base_v: torch.Tensor,
        consumer: str,
        delta_k: torch.Tensor,
        delta_v: torch.Tensor,
        rank: int | None,
        dtype: torch.dtype | None = None,
        svd: str = "gram",
        delta_rank: int | None = -1,
    ) -> Anchor:
        """Insert the observed correction; an anchor built from the same source gains a consumer.
        ``rank`` factors the base, ``delta_rank`` the deltas (-1: ``rank``; None: full)."""
        rd = rank if delta_rank == -1 else delta_rank
        dk, dv = Factor.make(delta_k, rd, dtype, svd), Factor.make(delta_v, rd, dtype, svd)
        for a in self.anchors:
            if a.source_key == source_key:
                a.deltas[consumer] = (dk, dv)
                return a
        if len(self.anchors) >= self.capacity:
            self.evict()
        anchor = Anchor(
            Factor.make(base_k, rank, dtype, svd),
            Factor.make(base_v, rank, dtype, svd),
            source_key,
            self.inserted,
            {consumer: (dk, dv)},
        )
        self.inserted += 1
        self.anchors.append(anchor)
        return anchor

    def evict(self) -> Anchor:
        """Least frequently used among the five oldest (ties: the oldest)."""
        oldest = sorted(self.anchors, key=lambda a: a.created)[:5]
        victim = min(oldest, key=lambda a: (a.count, a.created))
        self.anchors.remove(victim)
        self.evicted += 1
        return victim

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors)
