"""Online anchor pools shared by KVComm (full-dimensional) and KVCMAS (low-rank).

One pool per shared slot, process-wide. An anchor stores a base cache (keys in canonical, position-0
coordinates; values as they are) and, per consuming node, the observed correction Delta. Storage is
either the full ``[layers, S, D]`` matrices or truncated-SVD factors per layer, separately for K and
V. When the pool is full, the least frequently used anchor among the five oldest is evicted.

For the correction's GEMMs the pool keeps, per consumer, the ``B`` factors of that consumer's anchors
side by side (:class:`ConsumerStack`), updated on every insert and eviction; the large ``A`` factors
are never copied into a stack (the distance and apply kernels read them in place).
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


@dataclass(eq=False)
class ConsumerStack:
    """The low-rank ``B`` factors of one consumer's anchors side by side, per part:
    ``b[part]`` is ``[layers, sum r_v, D]`` in the order of ``anchors`` (parts stored full, e.g.
    full-dimensional deltas, are not stacked)."""

    consumer: str = ""
    anchors: list[Anchor] = field(default_factory=list)
    b: dict[str, torch.Tensor] = field(default_factory=dict)

    def _parts(self, anchor: Anchor) -> list[str]:
        return [p for p in PARTS if anchor.factor(p, self.consumer).b is not None]

    @classmethod
    def build(cls, anchors: list[Anchor], consumer: str) -> ConsumerStack:
        stack = cls(consumer, list(anchors))
        if anchors:
            parts = [p for p in PARTS if all(a.factor(p, consumer).b is not None for a in anchors)]
            stack.b = {p: torch.cat([a.factor(p, consumer).b for a in anchors], dim=1) for p in parts}
        return stack

    def append(self, anchor: Anchor) -> None:
        self.anchors.append(anchor)
        new = {p: anchor.factor(p, self.consumer).b for p in self._parts(anchor)}
        self.b = {p: torch.cat([self.b[p], new[p]], dim=1) for p in new} if len(self.anchors) > 1 else new

    def remove(self, anchor: Anchor) -> None:
        i = self.anchors.index(anchor)
        out = {}
        for p, t in self.b.items():
            lo = sum(a.factor(p, self.consumer).rank for a in self.anchors[:i])
            hi = lo + anchor.factor(p, self.consumer).rank
            out[p] = torch.cat([t[:, :lo], t[:, hi:]], dim=1)
        self.anchors.pop(i)
        self.b = out if self.anchors else {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.b.values())


@dataclass
class AnchorPool:
    capacity: int
    anchors: list[Anchor] = field(default_factory=list)
    inserted: int = 0
    evicted: int = 0
    #: per consumer, its anchors' B factors side by side (derived: rebuilt after a resume)
    stacks: dict[str, ConsumerStack] = field(default_factory=dict, repr=False, metadata={"transient": True})

    def compatible(self, consumer: str, k: int) -> list[Anchor]:
        """Anchors with a correction for ``consumer`` whose stored length is at least ``k``."""
        return [a for a in self.anchors if consumer in a.deltas and a.length >= k]

    def lengths(self, consumer: str) -> list[int]:
        return sorted((a.length for a in self.anchors if consumer in a.deltas), reverse=True)

    def stacked_b(self, consumer: str, anchors: list[Anchor]) -> dict[str, torch.Tensor]:
        """The B factors of ``anchors`` (all low-rank, all holding ``consumer``'s delta) side by side:
        the maintained stack when they are all of the consumer's anchors, else a fresh one."""
        stack = self.stacks.get(consumer)
        if stack is None:
            stack = self.stacks[consumer] = ConsumerStack.build(
                [a for a in self.anchors if consumer in a.deltas], consumer
            )
        if len(stack.anchors) == len(anchors) and all(x is y for x, y in zip(stack.anchors, anchors)):
            return stack.b
        return ConsumerStack.build(anchors, consumer).b

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
                self._stack_changed(a, consumer)
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
        self._stack_changed(anchor, consumer)
        return anchor

    def _stack_changed(self, anchor: Anchor, consumer: str) -> None:
        """Keep ``consumer``'s stack in pool order: a new last anchor is appended, anything else
        (a consumer added to an older anchor, a replaced delta) drops the stack until next use."""
        stack = self.stacks.get(consumer)
        if stack is None:
            return
        if anchor is self.anchors[-1] and anchor not in stack.anchors:
            stack.append(anchor)
        else:
            del self.stacks[consumer]

    def evict(self) -> Anchor:
        """Least frequently used among the five oldest (ties: the oldest)."""
        oldest = sorted(self.anchors, key=lambda a: a.created)[:5]
        victim = min(oldest, key=lambda a: (a.count, a.created))
        self.anchors.remove(victim)
        for stack in self.stacks.values():
            if victim in stack.anchors:
                stack.remove(victim)
        self.evicted += 1
        return victim

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors) + sum(s.nbytes for s in self.stacks.values())
