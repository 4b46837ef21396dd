"""What the engines and the methods exchange: prompt segments, requests, their KV caches, and the
result of running a request.

A :class:`Request` is a prompt cut into token-exact :class:`Segment` s (agent-specific PF, shared PH).
An engine runs it over a :class:`KVCache` whose row index is the absolute position (the attention
step over it, :class:`CacheRows`, is shared by every engine that runs layers itself), materializes
each shared segment as a :class:`SegmentKV` (what later agents reuse) and returns a
:class:`RequestResult`: the request's :class:`~kvcmas_bench.results.request.RequestRecord` (what is
written) with what stays in memory. No model code here: the in-process engine (:mod:`.engine`) and
the vLLM flow (:mod:`.serving.vllm.flow`) both build on these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .ops.kvmath import shift_keys
from .results.request import RequestRecord


class _Uids:
    """Identities of materializations (:attr:`SegmentKV.uid`), unique in the process.

    Process-wide on purpose: a method keys its learned state by the uid of the cache it learned from
    (a delta method's anchors), and one method sees caches made by every producer of the process
    (the in-process engine, the vLLM flow's captures, calibration), so ids drawn from one counter per
    engine or per run could collide. The learned state is saved with the counter's position and a
    resumed run continues after the saved ids (:meth:`advance`)."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1

    def advance(self, to: int) -> None:
        self.next = max(self.next, int(to))


UIDS = _Uids()


@dataclass
class Segment:
    """One token-exact piece of a prompt: agent-specific (PF) or shared (PH, with a slot id)."""

    kind: str
    ids: list[int]
    slot: str | None = None
    source: str | None = None
    name: str = ""
    #: input embeddings ``[S, hidden]`` fed instead of the token embeddings (visual tokens); ``ids``
    #: then holds placeholder ids of the same length, for bookkeeping and identity
    embeds: torch.Tensor | None = None
    #: identity of the content when ``ids`` do not carry it (visual segments: the image or video key)
    content_key: str | None = None
    #: a controlled reuse decision (serve-sweep ``--rho`` for every method): "dense" makes reuse
    #: methods prefill this segment densely (as a fallback), "reuse" makes gated methods reuse it
    #: whatever their gate says; None: the method decides
    schedule: str | None = None

    def __post_init__(self) -> None:
        if self.embeds is not None and self.embeds.shape[0] != len(self.ids):
            raise ValueError("embeds must have one row per segment id")
        if self.kind not in ("PF", "PH"):
            raise ValueError(f"segment kind must be PF or PH, not {self.kind!r}")
        if self.kind == "PH" and not self.slot:
            raise ValueError("a PH segment needs a slot id")
        if self.schedule not in (None, "dense", "reuse"):
            raise ValueError(f"segment schedule must be dense, reuse or None, not {self.schedule!r}")


@dataclass
class Request:
    agent: str
    segments: list[Segment]
    max_new_tokens: int = 32
    #: the workflow node issuing the request (role + position); None outside a workflow
    node: str | None = None

    @property
    def consumer(self) -> str:
        """Who consumes the request's shared segments: its workflow node, else its agent."""
        return self.node or self.agent

    @property
    def prompt_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]


@dataclass
class SegmentKV:
    """Per-layer K/V of one segment, ``[layers, kv_heads, tokens, head_dim]``, at positions start.."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    ids: tuple[int, ...]
    slot: str | None = None
    agent: str | None = None
    status: str = "exact"
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    #: identity of the materialization this cache (or its re-aligned view) comes from
    uid: int = field(default_factory=UIDS)
    #: the workflow node that materialized it
    node: str | None = None

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        return n + sum(h.numel() * h.element_size() for h in self.hidden.values())

    def detach(self) -> None:
        """Own copies of K and V instead of views (of a request cache it was written into)."""
        self.k, self.v = self.k.clone(), self.v.clone()

    def aligned(self, start: int, inv_freq: torch.Tensor) -> SegmentKV:
        """The same cache with keys rotated so the segment begins at ``start``."""
        return SegmentKV(
            k=shift_keys(self.k, start - self.start, inv_freq),
            v=self.v,
            start=start,
            ids=self.ids,
            slot=self.slot,
            agent=self.agent,
            status=self.status,
            hidden=self.hidden,
            uid=self.uid,
            node=self.node,
        )


class KVCache:
    """Preallocated per-request cache; row index == absolute position."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        shape = (layers, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def nbytes_used(self) -> int:
        per_row = self.k[:, :, :1].numel() * self.k.element_size() * 2
        return per_row * self.length

    def write(self, kv: SegmentKV) -> None:
        s, e = kv.start, kv.start + kv.length
        if not self.holds(kv):
            self.k[:, :, s:e] = kv.k.to(self.k.dtype)
            self.v[:, :, s:e] = kv.v.to(self.v.dtype)
        self.length = max(self.length, e)

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows ``start .. end`` (K, V): where a method may write a segment in place."""
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def holds(self, kv: SegmentKV) -> bool:
        """Whether ``kv`` is this cache's own rows at its positions (written in place)."""
        k, v = self.rows(kv.start, kv.start + kv.length)
        return kv.k.data_ptr() == k.data_ptr() and kv.v.data_ptr() == v.data_ptr() and kv.k.stride() == k.stride()

    def segment(self, start: int, end: int, **meta) -> SegmentKV:
        return SegmentKV(k=self.k[:, :, start:end].clone(), v=self.v[:, :, start:end].clone(), start=start, **meta)


class CacheRows:
    """The cache rows a partial forward computes (absolute positions, any order) and the causal
    mask of their queries over every row up to the last one: the attention step every engine that
    runs layers over a :class:`KVCache` shares."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        T = positions.numel()
        self.p0, self.p1 = int(positions[0]), int(positions[-1])
        self.contiguous = self.p1 - self.p0 + 1 == T and bool((positions.diff() == 1).all()) if T > 1 else True
        self.kmax = int(positions.max()) + 1
        self.mask = None
        if T > 1 or self.kmax > self.p1 + 1:
            key_pos = torch.arange(self.kmax, device=positions.device)
            self.mask = key_pos[None, :] <= positions[:, None]

    def attend(
        self, cache: KVCache, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, probe=None
    ) -> torch.Tensor:
        """Write layer ``li``'s ``k``/``v`` (``[1, kv_heads, T, D]``) at these rows, then attend ``q``
        (``[1, heads, T, D]``) causally over rows ``[0, kmax)``; returns ``[1, heads, T, D]``."""
        if self.contiguous:
            cache.k[li, :, self.p0 : self.p1 + 1] = k[0]
            cache.v[li, :, self.p0 : self.p1 + 1] = v[0]
        else:
            cache.k[li][:, self.positions] = k[0]
            cache.v[li][:, self.positions] = v[0]
        K = cache.k[li, :, : self.kmax][None]
        V = cache.v[li, :, : self.kmax][None]
        if probe is not None:
            probe(li, q, K, self.mask, scale)
        return F.scaled_dot_product_attention(q, K, V, attn_mask=self.mask, scale=scale, enable_gqa=True)


class HeadReduction:
    """The tensor-parallel hook of a segment context, as the delta methods use it: ``head_shards``,
    how many ranks hold the context's KV heads between them (each cache it hands out holds one
    rank's heads only), and :meth:`reduce_heads`, a figure summed over this rank's heads summed over
    every rank's (the same tensor on every rank), which makes a distance over all heads and the
    decision taken on it rank-independent. This default: one process holds every head. The
    tensor-parallel implementation is :class:`~kvcmas_bench.serving.vllm.tp.ShardedHeads`."""

    head_shards: int = 1

    def reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        return t


@dataclass
class RequestResult:
    """One request as an engine ran it: its :class:`~kvcmas_bench.results.request.RequestRecord`
    (timings, token counts, segment records, bytes, first token, fidelity: what is written, the
    workflow adding the step's own fields with :func:`~kvcmas_bench.workflow.step_record`), and
    what stays in memory: the generated ids, the caches later agents reuse (``materialized`` by
    slot, ``output_kv``) and, with fidelity, the first token's logits.

    Every field of the record reads through: ``result.ttft_s`` is ``result.record.ttft_s``."""

    record: RequestRecord
    output_ids: list[int]
    materialized: dict[str, SegmentKV] = field(default_factory=dict)
    output_kv: SegmentKV | None = None
    first_logits: torch.Tensor | None = None

    def __getattr__(self, name: str):
        if name == "record" or name.startswith("__"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.record, name)
