"""In-process execution engine: token-exact segments, per-segment KV, RoPE re-alignment, decode.

The engine runs the model's own modules layer by layer (norms, projections, rotary, grouped-query
attention, MLP) over a preallocated per-request cache whose row index equals the absolute position.
That one loop serves dense prefill, partial forwards of chosen tokens through chosen layers, and
decode, so every method is executed and measured by the same code. Methods decide how each shared
(PH) segment is materialized through :class:`SegmentContext`; the engine never knows which method runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .memory import peak_rss
from .modeling import check_supported
from .ops.kvmath import rotate_half, shift_keys
from .results.request import SegmentRecord


class _Uids:
    """Process-wide identities of materializations; a resumed run continues after the saved ones."""

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


@dataclass
class RequestResult:
    agent: str
    output_ids: list[int]
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    prefilled_tokens: int
    reused_tokens: int
    reference_tokens: int
    recomputed_token_layers: int
    eligible_tokens: int
    segments: list[SegmentRecord]
    materialized: dict[str, SegmentKV]
    output_kv: SegmentKV | None
    kv_bytes: int
    peak_rss_bytes: int
    device_peak_bytes: int | None
    first_token: int | None = None
    #: seconds of deferred work after the first token (anchor construction), inside E2E
    deferred_s: float = 0.0
    first_logits: torch.Tensor | None = None
    fidelity: dict | None = None


@dataclass
class _PrefillState:
    """Counters and products of one request's prefill."""

    prefilled: int = 0
    reused: int = 0
    reference: int = 0
    recomputed: int = 0
    eligible: int = 0
    excluded: float = 0.0
    records: list[SegmentRecord] = field(default_factory=list)
    materialized: dict[str, SegmentKV] = field(default_factory=dict)
    deferred: list[Callable[[], None]] = field(default_factory=list)
    #: with fidelity: the full dense prefill of the prompt (:class:`~kvcmas_bench.fidelity.DenseReference`)
    reference_kv: object = None

    def counts(self) -> dict:
        """The request result's token counts, segment records and materialized segments."""
        return {
            "prefilled_tokens": self.prefilled,
            "reused_tokens": self.reused,
            "reference_tokens": self.reference,
            "recomputed_token_layers": self.recomputed,
            "eligible_tokens": self.eligible,
            "segments": self.records,
            "materialized": self.materialized,
        }

    def add_segment(self, kv: SegmentKV, ctx: SegmentContext, eligible: bool) -> int:
        """Count one materialized PH segment: its cache, its deferred work, the tokens it prefilled,
        read as reference, recomputed, was eligible for and reused; returns the reused tokens."""
        S = len(ctx.segment.ids)
        self.materialized[ctx.segment.slot] = kv
        self.deferred.extend(ctx.deferred)
        self.prefilled += ctx.prefilled
        self.reference += ctx.reference_tokens
        self.recomputed += ctx.recomputed_token_layers
        reused = S - ctx.prefilled if kv.status != "exact" else 0
        self.eligible += S if eligible else 0
        self.reused += reused
        return reused


@dataclass
class PromptPiece:
    """One span of a prompt in a whole-prompt pass (:meth:`~kvcmas_bench.methods.base.Method.materialize_prompt`):
    rows ``start .. start + length`` with their input embeddings ``x`` (``[1, S, hidden]``), and
    ``old``, the aligned source K/V the method may reuse (None: every row computed at every layer)."""

    start: int
    x: torch.Tensor
    old: SegmentKV | None = None
    #: set by the pass: "exact" (computed), "recomputed" (partly) or "reused" (as is)
    status: str = "exact"
    #: set by the pass: (token, layer) entries of a reused piece it recomputed
    recomputed_token_layers: int = 0

    @property
    def length(self) -> int:
        return self.x.shape[1]


class SegmentContext:
    """What a method sees and may ask of the engine while materializing one PH segment."""

    def __init__(
        self, engine: Engine, cache: KVCache, request: Request, segment: Segment, start: int, source: SegmentKV | None
    ):
        self.engine = engine
        self.cache = cache
        self.request = request
        self.segment = segment
        self.start = start
        self.source = source
        self.prefilled = 0
        self.reference_tokens = 0
        self.recomputed_token_layers = 0
        self.deferred: list[Callable[[], None]] = []
        #: method accounting of this segment (gate entropy, comparison prefix, ...), recorded as is
        self.details: dict = {}

    @property
    def agent(self) -> str:
        return self.request.agent

    @property
    def consumer(self) -> str:
        """The workflow node consuming this segment: what anchors and calibration are keyed by
        (two nodes with the same role, e.g. in later rounds, are different consumers)."""
        return self.request.consumer

    @property
    def slot(self) -> str:
        return self.segment.slot  # type: ignore[return-value]

    @property
    def forced(self) -> str | None:
        """The segment's scheduled decision ("dense", "reuse") under a controlled reuse ratio."""
        return self.segment.schedule

    @property
    def length(self) -> int:
        return len(self.segment.ids)

    def dense(self, keep_hidden: Iterable[int] = ()) -> SegmentKV:
        """Exact prefill of the segment over the cache built so far."""
        kv, _ = self.engine.prefill(
            self.cache,
            self.segment.ids,
            self.start,
            keep_hidden=keep_hidden,
            slot=self.slot,
            agent=self.agent,
            embeds=self.segment.embeds,
        )
        self.prefilled += self.length
        return kv

    #: how many tensor-parallel ranks hold this cache's KV heads between them (each rank sees its own
    #: heads only; 1: this process holds them all)
    head_shards: int = 1

    def reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        """A figure summed over this rank's KV heads, summed over every rank's (the same tensor on
        every rank): what makes a distance over all heads, and the decision taken on it, rank-independent.
        Identity on one device."""
        return t

    def aligned_source(self) -> SegmentKV:
        """The source segment's cache, keys rotated to this segment's positions."""
        if self.source is None:
            raise RuntimeError("no source segment for this slot")
        return self.source.aligned(self.start, self.engine.inv_freq)

    def reference(self, keep_hidden: Iterable[int] = ()) -> SegmentKV:
        """Context-free reference: the segment prefilled alone at positions 0.. (counted in TTFT)."""
        kv = self.engine.prefill_alone(
            self.segment.ids, keep_hidden=keep_hidden, slot=self.slot, embeds=self.segment.embeds
        )
        self.reference_tokens += self.length
        return kv

    def write(self, kv: SegmentKV) -> None:
        """Place ``kv`` (at this segment's rows) into the request cache, e.g. before a partial forward."""
        self.cache.write(kv)

    def output_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a method writes the segment's K/V it computes itself (``[layers, kv_heads, S, hd]``
        each): here the request cache's own rows, so the result needs no buffer and no copy of its
        own; a :class:`SegmentKV` over them is detached from the cache after the first token."""
        return self.cache.rows(self.start, self.start + self.length)

    def embed(self, rel: Sequence[int] | None = None) -> torch.Tensor:
        """Token embeddings ``[1, T, hidden]`` of the segment (or of the rows ``rel``)."""
        if self.segment.embeds is not None:
            e = self.segment.embeds if rel is None else self.segment.embeds[torch.as_tensor(list(rel))]
            return e[None].to(self.engine.device, self.engine.dtype)
        ids = self.segment.ids if rel is None else [self.segment.ids[i] for i in rel]
        return self.engine.embed_ids(ids)

    def forward(
        self,
        h: torch.Tensor,
        rel: Sequence[int] | torch.Tensor,
        layers: Sequence[int] | range,
        keep_hidden: Iterable[int] = (),
        attn_probe: Callable | None = None,
        count: bool = True,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Partial forward: push the hidden states of segment rows ``rel`` through ``layers``.

        Their recomputed K/V overwrite those rows in each layer; their queries attend causally over
        the whole cache (prefix + the segment as it currently stands). Counted as recomputation.
        """
        rel_t = torch.as_tensor(rel, device=self.engine.device, dtype=torch.long)
        out = self.engine.run_layers(self.cache, h, rel_t + self.start, layers, keep_hidden, attn_probe)
        if count:
            self.recomputed_token_layers += rel_t.numel() * len(layers)
        return out

    def current(self, status: str) -> SegmentKV:
        """The segment's rows as they stand in the request cache."""
        return self.cache.segment(
            self.start,
            self.start + self.length,
            ids=tuple(self.segment.ids),
            slot=self.slot,
            agent=self.agent,
            status=status,
        )

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after the request's first token (outside TTFT, inside E2E and peak memory)."""
        self.deferred.append(fn)

    def exact_layer0(self, kv: SegmentKV, reference: SegmentKV | None = None) -> SegmentKV:
        """``kv`` with layer 0 recomputed exactly (layer-0 K/V depend only on tokens and positions):
        here a forward of the segment's tokens through layer 0 over the request cache, counted as
        recomputation (S token-layers: not served by reuse, so outside rho's numerator).
        ``reference`` (any cache of the same tokens) is for engines without a partial forward, which
        take layer 0 from it re-aligned (counted alike, so rho means the same on both engines)."""
        self.write(kv)
        self.forward(self.embed(), range(self.length), [0])
        return self.current(kv.status)


def _prompt_length(request: Request) -> int:
    """The prompt's token count; a request must end with a non-empty PF segment."""
    segs = request.segments
    if not segs or segs[-1].kind != "PF" or not segs[-1].ids:
        raise ValueError("a request must end with a non-empty PF segment")
    return sum(len(s.ids) for s in segs)


def _first_token_fidelity(reference_kv, logits: torch.Tensor) -> dict:
    """With fidelity: the first token's logits and their agreement with the dense reference's."""
    from .fidelity import request_fidelity

    fid = request_fidelity(reference_kv.logits, logits)
    return {"first_logits": logits.detach().cpu(), "fidelity": fid}


def _ph_record(ctx: SegmentContext, kv: SegmentKV, eligible: bool, reused: int, took: float) -> SegmentRecord:
    """The record of one materialized PH segment."""
    src = ctx.source
    return SegmentRecord(
        kind="PH",
        slot=ctx.segment.slot,
        tokens=len(ctx.segment.ids),
        status=kv.status,
        source_agent=src.agent if src is not None else None,
        source_node=src.node if src is not None else None,
        eligible=eligible,
        reused_tokens=reused,
        prefilled_tokens=ctx.prefilled,
        reference_tokens=ctx.reference_tokens,
        recomputed_token_layers=ctx.recomputed_token_layers,
        materialize_s=took,
        details=dict(ctx.details),
    )


def _add_errors(rec: SegmentRecord, kv: SegmentKV, exact: SegmentKV, reference_rows) -> None:
    """With fidelity: the segment's errors against the full dense prefill's rows (``kv_rel_error``,
    ...) and against its dense prefill over the cache as built (``local_kv_rel_error``)."""
    from .fidelity import kv_error, segment_errors

    for k, v in segment_errors(kv, *reference_rows).items():
        setattr(rec, k, v)
    rec.local_kv_rel_error = kv_error(kv.k, kv.v, exact.k, exact.v)


class Engine:
    """Runs requests on one model, one at a time, with exact per-segment bookkeeping."""

    def __init__(self, model: torch.nn.Module, tokenizer=None):
        self.config = getattr(model.config, "text_config", None) or model.config
        check_supported(self.config)
        self.model = model
        self.tokenizer = tokenizer
        base = model.model
        base = getattr(base, "language_model", base)  # vision-language models wrap a causal LM
        self.layers = base.layers
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head
        self.inv_freq = self.rotary.inv_freq
        if abs(float(getattr(self.rotary, "attention_scaling", 1.0)) - 1.0) > 1e-12:
            raise ValueError("rotary attention_scaling != 1 is not supported")
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_layers = len(self.layers)
        self.n_kv = self.config.num_key_value_heads
        self.param = next(model.parameters())
        self.device = self.param.device
        self.dtype = self.param.dtype
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else self.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))

    # ---- timing and memory -------------------------------------------------------------------
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def device_peak(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None

    @staticmethod
    def peak_rss() -> int:
        return peak_rss()

    # ---- model execution ---------------------------------------------------------------------
    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.n_layers, self.n_kv, self.head_dim, capacity, self.dtype, self.device)

    @torch.no_grad()
    def run_layers(
        self,
        cache: KVCache,
        h: torch.Tensor,
        positions: torch.Tensor,
        layers: Sequence[int] | range | None = None,
        keep_hidden: Iterable[int] = (),
        attn_probe: Callable | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Push hidden states ``h`` ([1, T, hidden]) at ``positions`` through ``layers``.

        Each layer writes the tokens' K/V into the cache rows ``positions`` and lets their queries
        attend causally (key position <= query position) over every cache row up to the last one.
        ``keep_hidden`` returns the residual stream entering the named layers.
        """
        layers = range(self.n_layers) if layers is None else layers
        keep = set(keep_hidden)
        kept: dict[int, torch.Tensor] = {}
        positions = positions.to(self.device)
        T = positions.numel()
        rows = CacheRows(positions)
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[:, None], sin[:, None]
        for li in layers:
            layer = self.layers[li]
            if li in keep:
                kept[li] = h[0].clone()
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, T, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, T, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, T, -1, self.head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            out = rows.attend(cache, li, q, k, v, attn.scaling, attn_probe)
            out = attn.o_proj(out.transpose(1, 2).reshape(1, T, -1))
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        cache.length = max(cache.length, rows.kmax)
        return h, kept

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    def embed_ids(self, ids: Sequence[int]) -> torch.Tensor:
        return self.embed(torch.as_tensor(list(ids), device=self.device)[None])

    @torch.no_grad()
    def prefill(
        self,
        cache: KVCache,
        ids: Sequence[int],
        start: int,
        keep_hidden: Iterable[int] = (),
        slot: str | None = None,
        agent: str | None = None,
        embeds: torch.Tensor | None = None,
    ) -> tuple[SegmentKV, torch.Tensor]:
        """Dense prefill of ``ids`` (or ``embeds``) at ``start`` over the cache; returns the segment KV
        and the hidden states of its rows."""
        positions = torch.arange(start, start + len(ids), device=self.device)
        x = embeds[None].to(self.device, self.dtype) if embeds is not None else self.embed_ids(ids)
        h, kept = self.run_layers(cache, x, positions, keep_hidden=keep_hidden)
        kv = cache.segment(start, start + len(ids), ids=tuple(ids), slot=slot, agent=agent)
        kv.hidden = kept
        return kv, h

    def prefill_alone(
        self,
        ids: Sequence[int],
        keep_hidden: Iterable[int] = (),
        slot: str | None = None,
        embeds: torch.Tensor | None = None,
    ) -> SegmentKV:
        """The segment prefilled with no prefix (positions 0..S-1)."""
        cache = self.new_cache(len(ids))
        kv, _ = self.prefill(cache, ids, 0, keep_hidden=keep_hidden, slot=slot, embeds=embeds)
        return kv

    # ---- requests ----------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        request: Request,
        method,
        sources: dict[str, SegmentKV] | None = None,
        fidelity: bool = False,
        keep_output_kv: bool = True,
    ) -> RequestResult:
        """Prefill segment by segment (PH through ``method``), then decode greedily.

        TTFT ends at the first token's logits: it includes every method decision, correction and
        context-free reference prefill, and excludes the deferred work (anchor construction) that
        runs right after it, and the fidelity reference prefill. E2E includes both the deferred
        work and decode.
        """
        prompt_len = _prompt_length(request)
        cache = self.new_cache(prompt_len + request.max_new_tokens + 1)
        st = _PrefillState()
        if fidelity:  # the full dense prefill every segment and the first token are compared with
            from .fidelity import dense_reference

            st.reference_kv = dense_reference(self, request.prompt_ids, self.prompt_embeds(request))
        t0 = self.now()
        h = self._prefill(request, method, sources or {}, cache, st, fidelity)
        logits = self.logits(h[:, -1:])[0, -1]
        ttft = self.now() - t0 - st.excluded
        deferred_s = self._run_deferred(st)
        first = int(logits.argmax())
        out, output_kv = self._decode(cache, request, method, first, prompt_len, keep_output_kv)
        e2e = self.now() - t0 - st.excluded
        fid = _first_token_fidelity(st.reference_kv, logits) if fidelity else {}
        return RequestResult(
            agent=request.agent,
            output_ids=out,
            ttft_s=ttft,
            e2e_s=e2e,
            prompt_tokens=prompt_len,
            **st.counts(),
            output_kv=output_kv,
            kv_bytes=cache.nbytes_used,
            peak_rss_bytes=self.peak_rss(),
            device_peak_bytes=self.device_peak(),
            first_token=first,
            deferred_s=deferred_s,
            **fid,
        )

    def _run_deferred(self, st: _PrefillState) -> float:
        """The work the method deferred past the first token (anchor construction); its seconds."""
        td = self.now()
        for fn in st.deferred:
            fn()
        return self.now() - td

    def _prefill(
        self, request: Request, method, sources: dict[str, SegmentKV], cache: KVCache, st: _PrefillState, fidelity: bool
    ) -> torch.Tensor:
        """Every segment in order: PF densely, PH through ``method``; returns the last hidden states."""
        h = None
        pos = 0
        for seg in request.segments:
            S = len(seg.ids)
            if seg.kind == "PF":
                if S:
                    _, h = self.prefill(cache, seg.ids, pos, agent=request.agent, embeds=seg.embeds)
                    st.prefilled += S
                st.records.append(SegmentRecord(kind="PF", name=seg.name, tokens=S, status="exact"))
            else:
                st.records.append(self._materialize(request, seg, pos, method, sources, cache, st, fidelity))
            pos += S
        return h

    def _materialize(
        self,
        request: Request,
        seg: Segment,
        pos: int,
        method,
        sources: dict[str, SegmentKV],
        cache: KVCache,
        st: _PrefillState,
        fidelity: bool,
    ) -> SegmentRecord:
        """One PH segment: the method decides, the engine writes, counts and (optionally) compares:
        with the full dense prefill's rows (``kv_rel_error``, ...) and with a dense prefill of the
        segment over the cache as built so far (``local_kv_rel_error``)."""
        S = len(seg.ids)
        exact = self._dense_segment(request, seg, pos, cache, st) if fidelity else None
        ctx = SegmentContext(self, cache, request, seg, pos, sources.get(seg.slot))
        eligible = bool(method.eligible(ctx.source is not None))  # fixed before the method runs
        t0 = self.now()
        kv = method.materialize(ctx)
        took = self.now() - t0
        if kv.length != S or kv.start != pos:
            raise RuntimeError(f"method returned a segment of {kv.length} rows at {kv.start}, expected {S} at {pos}")
        kv.slot, kv.agent, kv.node = seg.slot, request.agent, request.node
        if cache.holds(kv):  # written in place: the later agents' copy is made after the first token
            st.deferred.insert(0, kv.detach)
        cache.write(kv)
        reused = st.add_segment(kv, ctx, eligible)
        rec = _ph_record(ctx, kv, eligible, reused, took)
        if exact is not None:
            _add_errors(rec, kv, exact, st.reference_kv.rows(pos, S))
        return rec

    def _dense_segment(self, request: Request, seg: Segment, pos: int, cache: KVCache, st: _PrefillState) -> SegmentKV:
        """With fidelity: the segment prefilled densely over the cache as built so far, its rows then
        cleared for the method; the time it takes is excluded from TTFT and E2E."""
        tf = self.now()
        exact, _ = self.prefill(cache, seg.ids, pos, agent=request.agent, embeds=seg.embeds)
        cache.k[:, :, pos : pos + len(seg.ids)] = 0
        cache.v[:, :, pos : pos + len(seg.ids)] = 0
        st.excluded += self.now() - tf
        return exact

    def _decode(
        self, cache: KVCache, request: Request, method, token: int, prompt_len: int, keep_output_kv: bool
    ) -> tuple[list[int], SegmentKV | None]:
        """Greedy decode from the first token; the output's own cache (and the hidden states the
        method asks for) become the source of ``out:<agent>`` for later agents."""
        out: list[int] = []
        fed = prompt_len
        keep = tuple(getattr(method, "decode_hidden_layers", ()) or ())
        out_hidden: dict[int, list[torch.Tensor]] = {li: [] for li in keep}

        def feed(tok: int) -> torch.Tensor:
            nonlocal fed
            h, kept = self.run_layers(
                cache, self.embed_ids([tok]), torch.tensor([fed], device=self.device), keep_hidden=keep
            )
            for li, t in kept.items():
                out_hidden[li].append(t)
            fed += 1
            return h

        while token not in self.eos_ids:
            out.append(token)
            if len(out) >= request.max_new_tokens:
                break
            token = int(self.logits(feed(token))[0, -1].argmax())
        if not (keep_output_kv and out):
            return out, None
        if fed < prompt_len + len(out):
            feed(out[-1])
        output_kv = cache.segment(
            prompt_len, prompt_len + len(out), ids=tuple(out), agent=request.agent, status="exact"
        )
        output_kv.hidden = {li: torch.cat(v) for li, v in out_hidden.items() if v}
        return out, output_kv

    def prompt_embeds(self, request: Request) -> torch.Tensor | None:
        """Input embeddings of the whole prompt when a segment carries embeddings, else None."""
        if all(s.embeds is None for s in request.segments):
            return None
        parts = [
            s.embeds.to(self.device, self.dtype) if s.embeds is not None else self.embed_ids(s.ids)[0]
            for s in request.segments
            if s.ids
        ]
        return torch.cat(parts)

    @torch.no_grad()
    def dense_logits(self, ids: Sequence[int], embeds: torch.Tensor | None = None) -> torch.Tensor:
        """All-position logits of one dense forward of ``ids`` (the reference for tests/fidelity)."""
        cache = self.new_cache(len(ids))
        x = embeds[None].to(self.device, self.dtype) if embeds is not None else self.embed_ids(ids)
        h, _ = self.run_layers(cache, x, torch.arange(len(ids), device=self.device))
        return self.logits(h)[0]
