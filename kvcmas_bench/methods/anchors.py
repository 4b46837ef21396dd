"""Online anchor pools shared by KVComm (full-dimensional) and KVCMAS (low-rank).

One pool per shared slot, process-wide, of at most V anchors (paper A.3, C.3: "its capacity V is
applied independently to each slot"). An **anchor** is one observed instance of the slot's content
(one sample's question, one agent output); it holds one **entry** per consuming workflow node that
observed that instance through a dense fallback: the node's source representation (keys in
canonical, position-0 coordinates; values as they are) and its observed correction Delta. In a
chain every consumer reads a different source (agent 1 reads agent 0's cache, agent 2 agent 1's),
so entries have their own bases; non-chained methods compare against the context-free reference,
so all entries of an anchor share one base (stored once). V counts instances, so a consumer sees
up to V anchors of its own, whatever the number of consumers.

**Identity.** An anchor is identified by :attr:`Anchor.created`, the pool's insertion counter when
it was made (unique in the pool, increasing, never reused: the counter is persisted with the pool),
not by its content. The content digest (:func:`instance_key`, :attr:`Anchor.instance`) serves one
lookup only: a dense fallback joins the pool's newest anchor of the same content while that anchor
holds no entry for the falling-back consumer (the same observation met by the next consumer of the
chain); otherwise it makes a new anchor (paper A.3: a fallback "inserts ... a new anchor"). So two
fallbacks of one consumer on identical content give two anchors (until eviction), never one
overwritten entry.

Storage is either the full ``[layers, S, D]`` matrices or truncated-SVD factors per layer,
separately for K and V. When a new anchor is made in a full pool, the least frequently used
anchor among the five oldest is evicted, all its entries with it (:meth:`AnchorPool.evict`).

For the correction's GEMMs the small ``B`` factors of the entries in use are stacked per call
(:func:`stack_b`); the large ``A`` factors are never copied into a stack.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..ops.lowrank import factorize_many, rotate_rows, row_sqnorms

PARTS = ("base_k", "base_v", "delta_k", "delta_v")


def instance_key(ids: Sequence[int], content_key: str | None = None) -> str:
    """Content key of a slot's content: a digest of its token ids (and of the content key of
    segments whose ids are placeholders, such as an image's). Not an anchor's identity (identical
    content observed twice gives two anchors): only the lookup of :meth:`AnchorPool.joinable`."""
    data = (",".join(map(str, ids)) + f"|{content_key or ''}").encode()
    return f"{len(ids)}:{hashlib.sha1(data).hexdigest()[:16]}"


@dataclass(eq=False)
class Factor:
    """One ``[layers, S, D]`` matrix stack, stored full (``b is None``) or as ``a @ b``; low-rank
    factors keep their row norms ``sq`` (``[S]``, summed over layers) for the distance kernel."""

    a: torch.Tensor
    b: torch.Tensor | None = None
    sq: torch.Tensor | None = None

    @classmethod
    def make(cls, z: torch.Tensor, rank: int | None, dtype: torch.dtype | None = None, svd: str = "auto") -> Factor:
        """Full copy (``rank=None``) or rank-``rank`` SVD factors (``svd``: see :func:`factorize`), in ``dtype``."""
        return cls.make_all([(z, rank)], dtype, svd)[0]

    @classmethod
    def make_all(
        cls, items: list[tuple[torch.Tensor, int | None]], dtype: torch.dtype | None = None, svd: str = "auto"
    ) -> list[Factor]:
        """:meth:`make` of every ``(z, rank)`` pair, those of one rank factorized together
        (:func:`factorize_many`: one subspace iteration for an entry's K/V deltas and bases, its Gram
        matrices from bfloat16-rounded rows when the factors are stored in bfloat16)."""
        out: list[Factor | None] = [None] * len(items)
        keys = [(r, dtype or z.dtype) for z, r in items]  # each stack in ``dtype``, else its own
        for rank, dt in dict.fromkeys(keys):
            idx = [i for i, key in enumerate(keys) if key == (rank, dt)]
            zs = [items[i][0] for i in idx]
            if rank is None:
                made = [cls(z.to(dt, copy=True)) for z in zs]
            else:
                pairs = [(a.to(dt), b.to(dt)) for a, b in factorize_many(zs, rank, svd, gram_dtype=dt)]
                made = [cls(a, b, row_sqnorms(a)) for a, b in pairs]
            for i, f in zip(idx, made):
                out[i] = f
        return out

    @property
    def length(self) -> int:
        return self.a.shape[1]

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.a, self.b, self.sq) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, k: int) -> torch.Tensor:
        """Reconstruction of the first ``k`` rows, ``[layers, k, D]``."""
        return self.a[:, :k] if self.b is None else torch.bmm(self.a[:, :k], self.b)


@dataclass(eq=False)
class Entry:
    """One consumer's part of an anchor: the source it read (``base_k``/``base_v``, shared with the
    other entries that read the same source) and its observed correction (``delta_k``/``delta_v``)."""

    base_k: Factor
    base_v: Factor
    delta_k: Factor
    delta_v: Factor
    #: identity of the source materialization the base was built from
    source_key: tuple

    @property
    def base_nbytes(self) -> int:
        return self.base_k.nbytes + self.base_v.nbytes

    @property
    def delta_nbytes(self) -> int:
        return self.delta_k.nbytes + self.delta_v.nbytes


@dataclass(eq=False)
class Anchor:
    """One observation of the slot's content with an entry per consumer node that observed it."""

    #: content key (:func:`instance_key`): what a later consumer's entry of the same observation
    #: looks up, shared by every anchor of identical content
    instance: str
    #: the anchor's identity and age: the pool's insertion counter when it was made (unique in the
    #: pool, increasing, never reused); eviction's "oldest" and its tie-break
    created: int
    entries: dict[str, Entry] = field(default_factory=dict)
    count: int = 0

    @property
    def id(self) -> int:
        """The anchor's identity in its pool (:attr:`created`)."""
        return self.created

    @property
    def length(self) -> int:
        return next(iter(self.entries.values())).base_k.length

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the anchor holds, a base shared by several entries counted once."""
        seen: set[int] = set()
        n = 0
        for e in self.entries.values():
            for f in (e.base_k, e.base_v, e.delta_k, e.delta_v):
                for t in f.tensors():
                    if t.data_ptr() not in seen:
                        seen.add(t.data_ptr())
                        n += t.numel() * t.element_size()
        return n

    def factor(self, part: str, consumer: str) -> Factor:
        """The consumer's ``base_k``, ``base_v``, ``delta_k`` or ``delta_v``."""
        return getattr(self.entries[consumer], part)


def stack_b(anchors: list[Anchor], consumer: str, part: str) -> torch.Tensor:
    """The low-rank ``B`` factors of the consumer's ``part`` of ``anchors`` side by side:
    ``[layers, sum r_v, D]`` in the order of ``anchors``.

    Built per correction, not kept: ``B`` is ``[layers, r, D]`` per entry (a few MB for a full pool,
    milliseconds to copy) and a persistent stack per consumer would duplicate it in the method's state
    (for short segments ``B`` is larger than ``A``)."""
    return torch.cat([a.factor(part, consumer).b for a in anchors], dim=1)


@dataclass(eq=False)
class FactorStack:
    """One correction's view of the consumer's ``part`` (base_k, base_v, delta_k or delta_v) of the
    anchors in use: their factors, and for low-rank ones every ``B`` side by side (:func:`stack_b`,
    built once per correction, not per block). Row ranges ``[start, start + n)`` select the tokens
    of one block of the segment."""

    factors: list[Factor]
    #: ``[layers, sum r_v, D]``; None when the anchors are full-dimensional
    b_all: torch.Tensor | None

    @classmethod
    def of(cls, anchors: list[Anchor], consumer: str, part: str) -> FactorStack:
        factors = [a.factor(part, consumer) for a in anchors]
        low = all(f.b is not None for f in factors)
        return cls(factors, stack_b(anchors, consumer, part) if low else None)

    @property
    def lowrank(self) -> bool:
        return self.b_all is not None

    @functools.cached_property
    def b_t(self) -> torch.Tensor:
        """``B_all^T`` (``[layers, D, sum r_v]``), contiguous: the distance GEMM's operand."""
        return self.b_all.transpose(1, 2).contiguous()

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.factors]

    def rotated(self, delta: int, inv_freq: torch.Tensor, kv_heads: int) -> FactorStack:
        """Key factors moved ``delta`` positions on (low-rank only): every ``B`` rotated
        (:func:`~kvcmas_bench.ops.lowrank.rotate_rows`), the ``A`` factors shared as they are."""
        if not self.lowrank or delta == 0:
            return self
        return FactorStack(self.factors, rotate_rows(self.b_all, delta, inv_freq, kv_heads))

    def b_list(self) -> list[torch.Tensor | None]:
        """Each anchor's ``B`` (a view of :attr:`b_all`; None for full-dimensional anchors)."""
        if not self.lowrank:
            return [None] * len(self.factors)
        return list(torch.split(self.b_all, self.ranks, dim=1))

    def a_rows(self, start: int, n: int) -> list[torch.Tensor]:
        """Each anchor's ``A`` rows (full-dimensional: the matrix rows) of the block, as views."""
        return [f.a[:, start : start + n] for f in self.factors]

    def sq_rows(self, start: int, n: int) -> list[torch.Tensor]:
        return [f.sq[start : start + n] for f in self.factors]

    def rows(self, start: int, n: int) -> list[torch.Tensor]:
        """Each anchor's reconstructed rows of the block, ``[layers, n, D]``."""
        return [a if f.b is None else torch.bmm(a, f.b) for f, a in zip(self.factors, self.a_rows(start, n))]


@dataclass
class AnchorPool:
    capacity: int
    anchors: list[Anchor] = field(default_factory=list)
    inserted: int = 0
    evicted: int = 0

    def compatible(self, consumer: str, k: int) -> list[Anchor]:
        """Anchors with an entry for ``consumer`` whose stored length is at least ``k``."""
        return [a for a in self.anchors if consumer in a.entries and a.length >= k]

    def lengths(self, consumer: str) -> list[int]:
        return sorted((a.length for a in self.anchors if consumer in a.entries), reverse=True)

    def joinable(self, instance: str, consumer: str) -> Anchor | None:
        """The anchor a dense fallback of ``consumer`` on content ``instance`` adds its entry to: the
        pool's newest anchor of that content, if it holds no entry for ``consumer`` yet (the same
        observation, met by another consumer). None: the fallback makes a new anchor (no anchor of
        that content, or the newest one already has this consumer's entry: a second observation)."""
        newest = next((a for a in reversed(self.anchors) if a.instance == instance), None)
        return newest if newest is not None and consumer not in newest.entries else None

    def add(  # noqa: PLR0913  (the K/V base and delta of one observation, its key and factorization)
        self,
        instance: str,
        source_key: tuple,
        base_k: torch.Tensor,
        base_v: torch.Tensor,
        consumer: str,
        delta_k: torch.Tensor,
        delta_v: torch.Tensor,
        rank: int | None,
        dtype: torch.dtype | None = None,
        svd: str = "auto",
        delta_rank: int | None = None,
    ) -> Anchor:
        """Add the consumer's entry to the anchor :meth:`joinable` finds for content ``instance``, else
        to a new anchor (evicting first when the pool is full); returns that anchor. An existing
        entry is never overwritten. An entry whose source another entry of the anchor already read
        shares that entry's base factors. ``rank`` factors the base, ``delta_rank`` the deltas
        (None: ``rank``, as the methods' ``delta_rank`` knob; full-dimensional when ``rank`` is)."""
        rd = rank if delta_rank is None else delta_rank
        anchor = self.joinable(instance, consumer)
        entries = anchor.entries.values() if anchor is not None else ()
        same = next((e for e in entries if e.source_key == source_key), None)
        bases = [] if same is not None else [(base_k, rank), (base_v, rank)]
        # factorized before the pool changes: a failure (e.g. out of device memory) leaves it as it was
        dk, dv, *made = Factor.make_all([(delta_k, rd), (delta_v, rd), *bases], dtype, svd)
        bk, bv = (same.base_k, same.base_v) if same is not None else made
        if anchor is None:
            if len(self.anchors) >= self.capacity:
                self.evict()
            anchor = Anchor(instance, self.inserted)
            self.inserted += 1
            self.anchors.append(anchor)
        anchor.entries[consumer] = Entry(bk, bv, dk, dv, source_key)
        return anchor

    def evict(self) -> Anchor:
        """Removes and returns the whole anchor with the lowest activation ``count`` among the five
        oldest (smallest :attr:`Anchor.created`), ties going to the oldest of them (KVComm's rule,
        paper A.3). Not FIFO: an older anchor that the gate has used outlives a newer unused one."""
        oldest = sorted(self.anchors, key=lambda a: a.created)[:5]
        victim = min(oldest, key=lambda a: (a.count, a.created))
        self.anchors.remove(victim)
        self.evicted += 1
        return victim

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors)

    def layout(self) -> dict:
        """Anchors, entries and bytes of the pool (per anchor and per entry, base and delta apart)."""
        entries = [e for a in self.anchors for e in a.entries.values()]
        n_a, n_e = len(self.anchors), len(entries)
        delta = sum(e.delta_nbytes for e in entries)
        total = self.nbytes
        return _with_averages(
            {"anchors": n_a, "entries": n_e, "bytes": total, "delta_bytes": delta, "base_bytes": total - delta}
        )


#: the figures of :meth:`AnchorPool.layout` that add up over pools
LAYOUT_SUMS = ("anchors", "entries", "bytes", "base_bytes", "delta_bytes")


def _with_averages(layout: dict) -> dict:
    """``layout`` (with at least ``anchors``, ``entries`` and ``bytes``) plus ``bytes_per_anchor``
    and ``bytes_per_entry`` (0 when there is none): one pool's or a total over pools."""
    n_a, n_e = layout["anchors"], layout["entries"]
    layout["bytes_per_anchor"] = layout["bytes"] / n_a if n_a else 0.0
    layout["bytes_per_entry"] = layout["bytes"] / n_e if n_e else 0.0
    return layout


def total_layout(layouts: Sequence[dict]) -> dict:
    """The layout of several pools together: :data:`LAYOUT_SUMS` summed, averages over all of them."""
    return _with_averages({k: sum(p[k] for p in layouts) for k in LAYOUT_SUMS})
