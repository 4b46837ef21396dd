"""In-process execution engine: token-exact segments, per-segment KV, RoPE re-alignment, decode.

The engine runs the model's own modules layer by layer (norms, projections, rotary, grouped-query
attention, MLP) over a preallocated per-request cache whose row index equals the absolute position.
That one loop serves dense prefill, partial forwards of chosen tokens through chosen layers, and
decode, so every method is executed and measured by the same code. Methods decide how each shared
(PH) segment is materialized through :class:`SegmentContext`; the engine never knows which method runs.
The data it runs on (segments, requests, caches, results) is :mod:`kvcmas_bench.segments`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .memory import peak_rss
from .modeling import check_supported
from .ops.kvmath import rotate_half
from .results.request import RequestRecord, SegmentRecord
from .segments import CacheRows, HeadReduction, KVCache, Request, RequestResult, Segment, SegmentKV


@dataclass
class _PrefillState:
    """One request's prefill: what it runs (the request, the method, the sources of its shared
    slots, its cache, whether fidelity is measured), its counters and its products."""

    request: Request
    method: object
    sources: dict[str, SegmentKV]
    cache: KVCache
    fidelity: bool = False
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
        """The request record's token counts and segment records."""
        return {
            "prefilled_tokens": self.prefilled,
            "reused_tokens": self.reused,
            "reference_tokens": self.reference,
            "recomputed_token_layers": self.recomputed,
            "eligible_tokens": self.eligible,
            "segments": self.records,
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


class SegmentContext(HeadReduction):
    """What a method sees and may ask of the engine while materializing one PH segment (this process
    holds every KV head: the :class:`~kvcmas_bench.segments.HeadReduction` default)."""

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
        ``reference`` (any cache of the same tokens) is not read here: it is for engines without a
        partial forward (:class:`~kvcmas_bench.serving.vllm.flow.PlanContext`), which take layer 0
        from it re-aligned (counted alike, so rho means the same on both engines)."""
        self.write(kv)
        self.forward(self.embed(), range(self.length), [0])
        return self.current(kv.status)


def _prompt_length(request: Request) -> int:
    """The prompt's token count; a request must end with a non-empty PF segment."""
    segs = request.segments
    if not segs or segs[-1].kind != "PF" or not segs[-1].ids:
        raise ValueError("a request must end with a non-empty PF segment")
    return sum(len(s.ids) for s in segs)


def _fidelity(reference_kv, logits: torch.Tensor, segments: list[SegmentRecord]) -> dict:
    """With fidelity: the request record's agreement of the first token with the dense reference's
    (``top1_agree``, ``first_token_kl``) and the mean ``kv_rel_error`` of its shared segments (every
    one: the first agent's correction error of a non-chained method too)."""
    from .fidelity import request_fidelity

    errs = [s.kv_rel_error for s in segments if s.kv_rel_error is not None]
    return {**request_fidelity(reference_kv.logits, logits), "kv_rel_error": (sum(errs) / len(errs)) if errs else None}


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
        st = _PrefillState(request, method, sources or {}, cache, fidelity)
        if fidelity:  # the full dense prefill every segment and the first token are compared with
            from .fidelity import dense_reference

            st.reference_kv = dense_reference(self, request.prompt_ids, self.prompt_embeds(request))
        t0 = self.now()
        h = self._prefill(st)
        logits = self.logits(h[:, -1:])[0, -1]
        ttft = self.now() - t0 - st.excluded
        deferred_s = self._run_deferred(st)
        first = int(logits.argmax())
        out, output_kv = self._decode(st, first, prompt_len, keep_output_kv)
        e2e = self.now() - t0 - st.excluded
        fid = _fidelity(st.reference_kv, logits, st.records) if fidelity else {}
        record = RequestRecord(
            agent=request.agent,
            ttft_s=ttft,
            e2e_s=e2e,
            deferred_s=deferred_s,
            node=request.node,
            prompt_tokens=prompt_len,
            output_tokens=len(out),
            **st.counts(),
            kv_bytes=cache.nbytes_used,
            peak_rss_bytes=self.peak_rss(),
            device_peak_bytes=self.device_peak(),
            first_token_id=first,
            **fid,
        )
        first_logits = logits.detach().cpu() if fidelity else None
        return RequestResult(record, out, st.materialized, output_kv, first_logits)

    def _run_deferred(self, st: _PrefillState) -> float:
        """The work the method deferred past the first token (anchor construction); its seconds."""
        td = self.now()
        for fn in st.deferred:
            fn()
        return self.now() - td

    def _prefill(self, st: _PrefillState) -> torch.Tensor:
        """Every segment in order: PF densely, PH through the method; returns the last hidden states."""
        h = None
        pos = 0
        for seg in st.request.segments:
            S = len(seg.ids)
            if seg.kind == "PF":
                if S:
                    _, h = self.prefill(st.cache, seg.ids, pos, agent=st.request.agent, embeds=seg.embeds)
                    st.prefilled += S
                st.records.append(SegmentRecord(kind="PF", name=seg.name, tokens=S, status="exact"))
            else:
                st.records.append(self._materialize(st, seg, pos))
            pos += S
        return h

    def _materialize(self, st: _PrefillState, seg: Segment, pos: int) -> SegmentRecord:
        """One PH segment at ``pos``: the method decides, the engine writes, counts and (optionally)
        compares: with the full dense prefill's rows (``kv_rel_error``, ...) and with a dense prefill
        of the segment over the cache as built so far (``local_kv_rel_error``)."""
        S = len(seg.ids)
        request, cache = st.request, st.cache
        exact = self._dense_segment(st, seg, pos) if st.fidelity else None
        ctx = SegmentContext(self, cache, request, seg, pos, st.sources.get(seg.slot))
        eligible = bool(st.method.eligible(ctx.source is not None))  # fixed before the method runs
        t0 = self.now()
        kv = st.method.materialize(ctx)
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

    def _dense_segment(self, st: _PrefillState, seg: Segment, pos: int) -> SegmentKV:
        """With fidelity: the segment prefilled densely over the cache as built so far, its rows then
        cleared for the method; the time it takes is excluded from TTFT and E2E."""
        tf = self.now()
        cache = st.cache
        exact, _ = self.prefill(cache, seg.ids, pos, agent=st.request.agent, embeds=seg.embeds)
        cache.k[:, :, pos : pos + len(seg.ids)] = 0
        cache.v[:, :, pos : pos + len(seg.ids)] = 0
        st.excluded += self.now() - tf
        return exact

    def _decode(
        self, st: _PrefillState, token: int, prompt_len: int, keep_output_kv: bool
    ) -> tuple[list[int], SegmentKV | None]:
        """Greedy decode from the first token; the output's own cache (and the hidden states the
        method asks for) become the source of ``out:<agent>`` for later agents."""
        cache, request = st.cache, st.request
        out: list[int] = []
        fed = prompt_len
        keep = tuple(getattr(st.method, "decode_hidden_layers", ()) or ())
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
