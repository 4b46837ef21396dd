"""Running a trajectory's agents through a method on an engine that only takes whole requests.

The in-process engine asks the method for each shared (PH) segment *while* it prefills the
request. A serving engine gets a request once, whole, so here the method decides every segment
of an agent's request *before* it is submitted, against a :class:`PlanContext`:

- ``dense()`` returns a placeholder cache that vLLM fills: the segment is prefilled by vLLM inside
  the request (over whatever cache precedes it, as in-process) and captured into the placeholder;
  deferred work that uses it (anchor insertion) runs once the first token has arrived.
- ``aligned_source()`` re-aligns the source's post-RoPE keys with the model's own ``inv_freq``.
- ``reference()`` (context-free prefill) is a prefill-only request on the same engine: planning
  stops with :class:`NeedKV`, the client submits that request, and planning resumes at the same
  segment when its capture is in (so its time lands in the waiting request's TTFT).
- methods that recompute chosen tokens layer by layer (``Method.needs_model_internals``:
  CacheBlend) plan the whole prompt instead, on the worker's :class:`~.layers.ModelLayers` (vLLM's
  own modules over a per-request cache, ``Runtime.layers``): the system prompt from its capture,
  then every segment up to the end of the last shared segment with a source in one pass of the
  method through the layers (``Method.materialize_prompt``: private segments computed, shared ones
  as the method decides, the same cache as in-process segment by segment); vLLM is handed that
  cache as the claimed prefix and computes the rest, dense shared segments there captured
  (:meth:`TrajectoryRun._whole_prompt`;
  a prompt with no source to reuse is vLLM's alone).
  The in-process vLLM engine has no such runtime and refuses them.
- KVComm's exact layer 0 comes from the reference re-aligned: layer-0 K/V depend only on tokens
  and positions.

What the method returns becomes a :class:`~.connector.Plan`: the agent's system prompt (exact, one
cache per agent, captured once before timing) plus the first shared segment as a prefix the
connector claims, later reused/corrected segments as per-layer overrides, dense segments and the
agent's output (from decode) as captures. The rest (sources chained along the agent graph,
counters, records) is :func:`kvcmas_bench.workflow.execute`'s bookkeeping, reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ...engine import SegmentContext
from ...errors import BenchError
from ...methods.base import Method, PromptPiece
from ...ops.kvmath import shift_keys
from ...results.request import RequestRecord, SegmentRecord
from ...segments import KVCache, Request, RequestResult, SegmentKV
from ...workflow import AgentStep, Node, _sources, out_slot, step_record
from ..engines import trace_nodes
from ..traces import Trace
from .plan import Capture, Plan
from .tp import HeadShards, ShardedHeads


def plans_nothing(method_cls) -> bool:
    """Whether ``method_cls`` leaves every shared segment to a dense prefill (NonShared): its requests
    need no plan, no capture and no source, so they are served as plain requests."""
    return method_cls.materialize is Method.materialize


def agent_output(tokens: Iterable[int], max_new_tokens: int, eos_ids: set[int], ignore_eos: bool) -> list[int]:
    """An agent's output from the tokens vLLM generated for it: the first ``max_new_tokens`` (vLLM
    decodes one more, so the last output token's K/V exists), cut before the first EOS unless EOS is
    ignored. The one definition: the worker's record and chaining (:meth:`TrajectoryRun.finished`)
    and the HTTP client's next prompts both use it."""
    out = list(tokens)[:max_new_tokens]
    if not ignore_eos:
        for i, tok in enumerate(out):
            if tok in eos_ids:
                return out[:i]
    return out


class NeedKV(Exception):
    """Planning waits for a context-free prefill of ``ids`` (a prefill-only request)."""

    def __init__(self, ids: Iterable[int]):
        super().__init__("context-free prefill needed")
        self.ids = tuple(ids)


class ModelFacts:
    """What methods read from ``ctx.engine`` here: shapes, dtype, the rotary ``inv_freq``, and
    context-free references served by prefill-only requests (``ready``, filled by the client).

    Under tensor parallelism (``shards``, the worker of one rank) ``n_kv`` is the rank's own KV-head
    count: every cache here holds that rank's heads only (:mod:`.tp`)."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        n_layers: int,
        n_kv: int,
        head_dim: int,
        dtype,
        device,
        keep_ready: bool = False,
        shards: HeadShards | None = None,
    ):
        self.inv_freq = inv_freq
        self.n_layers, self.n_kv, self.head_dim = n_layers, n_kv, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.ready: dict[tuple[int, ...], SegmentKV] = {}
        #: keep references once served (the server side: the client asks for each one once); else
        #: each is used by the one request that waited for it
        self.keep_ready = keep_ready
        if shards is not None and shards.heads != n_kv:
            raise ValueError(f"rank {shards.rank} holds {shards.heads} KV heads, the facts say {n_kv}")
        #: this rank's KV heads and the TP group's collectives (None: one device holds every head)
        self.shards = shards

    def empty(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.n_layers, self.n_kv, tokens, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(
            shape, dtype=self.dtype, device=self.device
        )

    @property
    def token_bytes(self) -> int:
        return 2 * self.n_layers * self.n_kv * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def prefill_alone(self, ids, keep_hidden=(), slot=None, embeds=None) -> SegmentKV:
        """The segment prefilled alone at positions 0.. (each call costs one prefill-only request)."""
        if tuple(keep_hidden) or embeds is not None:
            raise BenchError("hidden states and input embeddings are not available on the vLLM engine")
        kv = self.ready.get(tuple(ids)) if self.keep_ready else self.ready.pop(tuple(ids), None)
        if kv is None:
            raise NeedKV(ids)
        return SegmentKV(k=kv.k, v=kv.v, start=0, ids=tuple(ids), slot=slot)


class PlanContext(ShardedHeads, SegmentContext):
    """:class:`~kvcmas_bench.engine.SegmentContext` for an engine that runs requests whole.

    Under tensor parallelism (``facts.shards``) the caches it hands the method hold the rank's KV
    heads; ``head_shards`` and :meth:`reduce_heads` (:class:`~.tp.ShardedHeads`: an all-reduce over
    the TP group) make the delta methods' gate and token weights span every head, so each rank takes
    the same decision."""

    def __init__(self, facts: ModelFacts, request: Request, segment, start: int, source: SegmentKV | None):
        self.engine = facts  # type: ignore[assignment]
        self.shards = facts.shards
        self.cache = None  # type: ignore[assignment]
        self.request, self.segment, self.start, self.source = request, segment, start, source
        self.prefilled = self.reference_tokens = self.recomputed_token_layers = 0
        self.deferred: list[Callable[[], None]] = []
        self.details: dict = {}
        self.placeholders: list[SegmentKV] = []

    def dense(self, keep_hidden: Iterable[int] = ()) -> SegmentKV:
        if tuple(keep_hidden):
            raise BenchError("hidden states are not available on the vLLM engine")
        k, v = self.engine.empty(self.length)
        kv = SegmentKV(k=k, v=v, start=self.start, ids=tuple(self.segment.ids), slot=self.slot, agent=self.agent)
        self.placeholders.append(kv)
        self.prefilled += self.length
        return kv

    def exact_layer0(self, kv: SegmentKV, reference: SegmentKV | None = None) -> SegmentKV:
        if reference is None or tuple(reference.ids) != tuple(self.segment.ids):
            raise BenchError("exact layer 0 on the vLLM engine needs a cache of the same tokens")
        kv.k[0] = shift_keys(reference.k[:1], self.start - reference.start, self.engine.inv_freq)[0].to(kv.k.dtype)
        kv.v[0] = reference.v[0].to(kv.v.dtype)
        self.recomputed_token_layers += self.length
        return kv

    def output_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh buffer: the connector copies a provided segment into vLLM's blocks."""
        f = self.engine
        shape = (f.n_layers, f.n_kv, self.length, f.head_dim)
        return torch.empty(shape, dtype=f.dtype, device=f.device), torch.empty(shape, dtype=f.dtype, device=f.device)

    def _internals(self, *_, **__):
        raise BenchError("this method needs partial forwards through the model's layers (not on the vLLM engine)")

    write = embed = forward = current = _internals  # type: ignore[assignment]


@dataclass
class Runtime:
    """What every trajectory run on one engine shares."""

    facts: ModelFacts
    #: exact K/V of agents' system prompts (position 0), by ids
    system_kv: dict[tuple[int, ...], SegmentKV] = field(default_factory=dict)
    eos_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = True
    #: salt injected/overridden requests (only needed when vLLM's prefix cache is on)
    salt_injected: bool = False
    #: record the first token's logprobs (tests)
    logprobs: int | None = None
    #: partial forwards on the served model (:class:`~.layers.ModelLayers`, made on first call):
    #: what methods that recompute tokens plan with; None where the model is out of reach
    layers: Callable[[], object] | None = None
    n: int = 0

    def model_layers(self):
        if self.layers is None:
            raise BenchError("this method needs partial forwards through the model's layers (only --engine vllm)")
        return self.layers()

    def key(self, what: str) -> str:
        self.n += 1
        return f"kvcmas-{what}-{self.n}"


@dataclass
class EngineRequest:
    """One request for the engine: ``kind`` "agent" (an agent of a trajectory) or "kv" (a
    prefill-only request whose K/V is captured)."""

    key: str
    prompt: list[int]
    max_tokens: int
    plan: Plan | None
    kind: str = "agent"
    salt: str | None = None
    logprobs: int | None = None


@dataclass
class _Agent:
    """One agent request being planned, then served."""

    node: Node
    request: Request
    sources: dict[str, SegmentKV]
    arrival_s: float
    before: dict
    seg: int = 0
    pos: int = 0
    records: list[SegmentRecord] = field(default_factory=list)
    modes: list[str | None] = field(default_factory=list)
    kvs: list[SegmentKV | None] = field(default_factory=list)
    materialized: dict[str, SegmentKV] = field(default_factory=dict)
    deferred: list[Callable[[], None]] = field(default_factory=list)
    reused: int = 0
    reference: int = 0
    recomputed: int = 0
    eligible: int = 0
    captures: list[Capture] = field(default_factory=list)
    output_capture: Capture | None = None
    engine_request: EngineRequest | None = None
    start_s: float | None = None
    first_token_s: float | None = None
    first_token: int | None = None
    first_logprobs: dict | None = None
    tokens: list[int] = field(default_factory=list)
    claimed: int | None = None
    #: the prompt's cache up to the end of segment ``until`` when the worker computes it
    #: (:meth:`TrajectoryRun._whole_prompt`): the last shared segment with a source
    cache: KVCache | None = None
    until: int | None = None
    #: prompt tokens the worker computed itself (dense ones in a whole-prompt plan)
    computed_here: int = 0


class TrajectoryRun:
    """One trajectory's agents in order (a chain: agent j reads every earlier output), each planned
    with ``method`` into an :class:`EngineRequest`; the client drives it (see :mod:`.client`)."""

    def __init__(
        self,
        rt: Runtime,
        trace: Trace | None,
        method,
        capture_outputs: bool,
        qps: float | None = None,
        trajectory_id: str | None = None,
    ):
        self.rt, self.trace, self.method, self.qps = rt, trace, method, qps
        self.plain = plans_nothing(type(method))  # NonShared: every segment dense
        #: recomputes tokens layer by layer: the worker computes the whole prompt (_whole_prompt)
        self.whole = bool(getattr(method, "needs_model_internals", False))
        self.capture_outputs = capture_outputs and not self.plain
        #: ``trace`` None: the server side, which gets each agent's node and request from its metadata
        self.nodes = trace_nodes(trace) if trace is not None else []
        self.id = trace.id if trace is not None else trajectory_id
        self.store: dict[str, list[tuple[int, SegmentKV]]] = {}
        #: NonShared keeps no cache, so its store stays empty: per slot, the agents that materialized
        #: it, so a segment counts as eligible where the other engines (which keep the dense caches) see a source
        self.produced: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.steps: list[AgentStep] = []
        self.records: list[RequestRecord] = []
        self.index = 0
        self.agent: _Agent | None = None
        #: per finished agent: its engine request key and first-token logprobs (when asked for)
        self.keys: list[str] = []
        self.agent_logprobs: list[dict | None] = []

    @property
    def done(self) -> bool:
        return self.index >= len(self.nodes)

    # ---- planning ------------------------------------------------------------------------------
    def begin(self, arrival_s: float) -> None:
        """The next agent arrives (its predecessor finished, or the trajectory starts)."""
        node = self.nodes[self.index]
        sources = _sources(self.store, node)
        req = self.trace.request(self.index, self.outputs, {slot: kv.agent for slot, kv in sources.items()})
        req.node = node.id
        self.begin_request(node, req, arrival_s, sources)

    def begin_request(self, node: Node, req: Request, arrival_s: float, sources=None) -> None:
        """Agent ``self.index`` arrives with its ``node`` and whole ``req`` (sources: from the store)."""
        sources = _sources(self.store, node) if sources is None else sources
        self.agent = _Agent(node, req, sources, arrival_s, self.method.counters())

    def plan(self) -> EngineRequest | NeedKV:
        """Materialize the agent's remaining segments; its engine request, or what it waits for."""
        a = self.agent
        if self.whole and a.cache is None:
            segs = a.request.segments
            a.until = max((i for i, s in enumerate(segs) if s.kind == "PH" and s.slot in a.sources), default=None)
            if a.until is not None:
                a.cache = self.rt.model_layers().new_cache(sum(len(s.ids) for s in segs[: a.until + 1]))
                self._prompt_pass(a)
        try:
            while a.seg < len(a.request.segments):
                self._segment(a, a.request.segments[a.seg])
                a.seg += 1
        except NeedKV as need:
            return need
        a.engine_request = self._whole_prompt(a) if a.cache is not None else self._engine_request(a)
        return a.engine_request

    def _segment(self, a: _Agent, seg) -> None:
        S = len(seg.ids)
        if seg.kind == "PF":
            a.records.append(SegmentRecord(kind="PF", name=seg.name, tokens=S, status="exact"))
            a.modes.append(None)
            a.kvs.append(None)
            a.pos += S
            return
        if self.plain:  # NonShared: vLLM prefills it, nobody needs its cache
            had = any(p in a.node.ancestors for p in self.produced.get(seg.slot, ()))
            kv, mode, took, eligible = None, "computed", 0.0, self.method.eligible(had)
            rec_kw: dict = {"status": "exact", "prefilled_tokens": S}
        else:
            ctx = PlanContext(self.rt.facts, a.request, seg, a.pos, a.sources.get(seg.slot))
            eligible = bool(self.method.eligible(ctx.source is not None))
            t0 = time.perf_counter()
            kv = self.method.materialize(ctx)  # NeedKV leaves a.seg here: planning resumes at this segment
            took = time.perf_counter() - t0
            if kv.length != S or kv.start != a.pos:
                raise RuntimeError(f"method returned {kv.length} rows at {kv.start}, expected {S} at {a.pos}")
            mode = "computed" if any(kv is p for p in ctx.placeholders) else "provided"
            if mode == "computed":
                a.captures.append(Capture(a.pos, kv.k, kv.v))
            a.deferred.extend(ctx.deferred)
            a.reference += ctx.reference_tokens
            rec_kw = self._materialized(a, seg, kv, ctx.source, ctx.prefilled, ctx.recomputed_token_layers)
            rec_kw.update(reference_tokens=ctx.reference_tokens, details=dict(ctx.details))
        a.eligible += S if eligible else 0
        a.records.append(
            SegmentRecord(kind="PH", slot=seg.slot, tokens=S, eligible=eligible, materialize_s=took, **rec_kw)
        )
        a.modes.append(mode)
        a.kvs.append(kv)
        a.pos += S

    def _materialized(
        self, a: _Agent, seg, kv: SegmentKV, source: SegmentKV | None, prefilled: int, recomputed: int
    ) -> dict:
        """Keep a shared segment's cache (the next agents' source) and count it; its record's fields."""
        kv.slot, kv.agent, kv.node = seg.slot, a.request.agent, a.request.node
        a.materialized[seg.slot] = kv
        reused = len(seg.ids) - prefilled if kv.status != "exact" else 0
        a.reused += reused
        a.recomputed += recomputed
        return {
            "status": kv.status,
            "source_agent": source.agent if source is not None else None,
            "source_node": source.node if source is not None else None,
            "reused_tokens": reused,
            "prefilled_tokens": prefilled,
            "recomputed_token_layers": recomputed,
        }

    def _prompt_pass(self, a: _Agent) -> None:
        """Segments ``0 .. until`` of a whole-prompt plan (:meth:`_whole_prompt`) in one pass of the
        method through the layers (:meth:`~kvcmas_bench.methods.base.Method.materialize_prompt`):
        the agent's system prompt from its capture, the other private segments and the shared ones
        without a source computed at every layer, the shared ones with a source as the method
        decides. Each shared segment's record gets the pass's time in proportion to the
        (token, layer) entries computed for it (``details["prompt_pass_s"]``: the whole pass)."""
        layers = self.rt.model_layers()
        L = layers.n_layers
        pieces: list[PromptPiece | None] = []
        for seg in a.request.segments[: a.until + 1]:
            sys_kv = self.rt.system_kv.get(tuple(seg.ids)) if seg.kind == "PF" and a.pos == 0 else None
            if sys_kv is not None:
                a.cache.write(sys_kv)
            source = a.sources.get(seg.slot) if seg.kind == "PH" else None
            computed = sys_kv is None and bool(seg.ids)
            x = layers.embed_ids(seg.ids) if computed else None
            pieces.append(
                PromptPiece(a.pos, x, None if source is None else source.aligned(a.pos, layers.inv_freq))
                if computed
                else None
            )
            a.pos += len(seg.ids)
        t0 = time.perf_counter()
        self.method.materialize_prompt(layers, a.cache, [p for p in pieces if p is not None])
        took = time.perf_counter() - t0
        cost = [0 if p is None else p.recomputed_token_layers if p.old is not None else p.length * L for p in pieces]
        a.pos = 0
        for seg, p, c in zip(a.request.segments[: a.until + 1], pieces, cost):
            S = len(seg.ids)
            if seg.kind == "PF":
                a.computed_here += S if p is not None else 0
                a.records.append(SegmentRecord(kind="PF", name=seg.name, tokens=S, status="exact"))
                a.modes.append(None)
                a.kvs.append(None)
            else:
                status = p.status if p is not None else "exact"
                kv = a.cache.segment(a.pos, a.pos + S, ids=tuple(seg.ids), status=status)
                source = a.sources.get(seg.slot)
                prefilled = S if source is None else 0
                a.computed_here += prefilled
                eligible = bool(self.method.eligible(source is not None))
                a.eligible += S if eligible else 0
                rec_kw = self._materialized(a, seg, kv, source, prefilled, c if source is not None else 0)
                rec_kw["details"] = {"prompt_pass_s": round(took, 6)}
                a.records.append(
                    SegmentRecord(
                        kind="PH",
                        slot=seg.slot,
                        tokens=S,
                        eligible=eligible,
                        materialize_s=took * c / max(1, sum(cost)),
                        **rec_kw,
                    )
                )
                a.modes.append("provided")
                a.kvs.append(kv)
            a.pos += S
        a.seg = a.until + 1

    def _whole_prompt(self, a: _Agent) -> EngineRequest:
        """The plan of a method that recomputes tokens (CacheBlend): the worker built the prompt's
        cache up to the end of its last shared segment with a source (:meth:`_prompt_pass`),
        claimed as the prefix (at most all
        but the last token); vLLM computes the rest, capturing the dense shared segments in it
        (the next agents' sources). A prompt with no source to reuse is vLLM's alone
        (:meth:`_engine_request`: every shared segment captured)."""
        n = min(a.cache.k.shape[2], len(a.request.prompt_ids) - 1)
        plan = Plan(prefix=(a.cache.k[:, :, :n], a.cache.v[:, :, :n]), captures=list(a.captures))
        for i, rec in enumerate(a.records):
            if rec.kind == "PH":
                rec.details["vllm"] = "prefix" if i <= a.until else "computed"
        return self._request(a, plan, injected=True)

    def _engine_request(self, a: _Agent) -> EngineRequest:
        """The plan: system prompt + first shared segment as the claimed prefix, later provided
        segments as overrides, computed ones and the output as captures."""
        segs = a.request.segments
        plan = Plan(captures=list(a.captures))
        first = 1 if segs[0].kind == "PF" else 0
        sys_kv = self.rt.system_kv.get(tuple(segs[0].ids)) if first else None
        prefix_ok = first < len(segs) and a.modes[first] == "provided" and (first == 0 or sys_kv is not None)
        pos = 0
        for i, (seg, mode, kv) in enumerate(zip(segs, a.modes, a.kvs)):
            if mode == "provided" and i == first and prefix_ok:
                k, v = (kv.k, kv.v) if first == 0 else (torch.cat([sys_kv.k, kv.k], 2), torch.cat([sys_kv.v, kv.v], 2))
                plan.prefix = (k, v)
                a.records[i].details["vllm"] = "prefix"
            elif mode == "provided":
                plan.overrides.append((pos, kv.k, kv.v))
                a.records[i].details["vllm"] = "override"
            elif mode == "computed":
                a.records[i].details["vllm"] = "computed"
            pos += len(seg.ids)
        return self._request(a, plan, injected=plan.prefix is not None or bool(plan.overrides))

    def _request(self, a: _Agent, plan: Plan, injected: bool) -> EngineRequest:
        """The engine request of ``plan``, with the agent's output captured (the next agents' source)."""
        n_out = a.request.max_new_tokens
        if self.capture_outputs:
            k, v = self.rt.facts.empty(n_out)
            a.output_capture = Capture(len(a.request.prompt_ids), k, v)
            plan.captures.append(a.output_capture)
        key = self.rt.key("agent")
        return EngineRequest(
            key=key,
            prompt=a.request.prompt_ids,
            # one token more than the agent's output: vLLM feeds every output token through the model
            # (its K/V is the next agent's source), as the in-process engine feeds the last one
            max_tokens=n_out + 1,
            plan=plan if (plan.prefix is not None or plan.overrides or plan.captures) else None,
            salt=key if injected and self.rt.salt_injected else None,
            logprobs=self.rt.logprobs,
        )

    # ---- serving events ------------------------------------------------------------------------
    def submitted(self, t: float) -> None:
        self.agent.start_s = t

    def first_token(self, t: float, token: int, logprobs: dict | None = None) -> None:
        """The first streamed token: the prompt's dense segments are captured; deferred work runs."""
        a = self.agent
        a.first_token_s, a.first_token, a.first_logprobs = t, token, logprobs
        for cap in a.captures:
            if not cap.complete:
                raise RuntimeError("vLLM finished the prefill but a dense segment was not captured whole")
        for fn in a.deferred:
            fn()

    def finished(self, t: float, tokens: list[int], claimed: int | None) -> RequestRecord:
        """The agent's request completed at ``t``: chain its caches, record it, move to the next agent."""
        a = self.agent
        out, output_kv = self._output(a, tokens)
        self._chain(a, out, output_kv)
        after = self.method.counters()
        self.steps.append(
            AgentStep(
                a.node,
                a.request,
                self._result(a, t, out, output_kv, claimed),
                "",
                shared_store_bytes=sum(kv.nbytes for h in self.store.values() for _, kv in h),
                method_state_bytes=self.method.state_bytes(),
                method_stats={k: v - a.before.get(k, 0) for k, v in after.items() if v != a.before.get(k, 0)},
            )
        )
        # the agent's position in the trajectory (in finishing order when agents run one at a time;
        # on the server, where siblings of a fan-out may be in flight at once, the index they were sent with)
        rec = step_record(self.steps[-1], self.index, self.rt.facts.n_layers, trajectory=self.id)
        rec.qps, rec.arrival_s, rec.start_s = self.qps, a.arrival_s, a.start_s
        rec.first_token_s, rec.completion_s = a.first_token_s, t
        rec.queue_s = a.start_s - a.arrival_s
        self.records.append(rec)
        self.keys.append(a.engine_request.key)
        self.agent_logprobs.append(a.first_logprobs)
        self.index += 1
        self.agent = None
        return rec

    def _output(self, a: _Agent, tokens: list[int]) -> tuple[list[int], SegmentKV | None]:
        """The agent's output (:func:`agent_output`) and its captured K/V."""
        out = agent_output(tokens, a.request.max_new_tokens, self.rt.eos_ids, self.rt.ignore_eos)
        cap = a.output_capture
        if cap is None or not out:
            return out, None
        if not bool(cap.filled[: len(out)].all()):
            raise RuntimeError("vLLM finished the request but its output K/V was not captured whole")
        kv = SegmentKV(k=cap.k[:, :, : len(out)], v=cap.v[:, :, : len(out)], start=cap.start, ids=tuple(out))
        kv.agent = a.request.agent
        return out, kv

    def _result(
        self, a: _Agent, t: float, out: list[int], output_kv: SegmentKV | None, claimed: int | None
    ) -> RequestResult:
        """The agent's request as served: its record (timings on the client's clock from its
        arrival) and the caches later agents reuse."""
        prompt = len(a.request.prompt_ids)
        record = RequestRecord(
            agent=a.request.agent,
            ttft_s=a.first_token_s - a.arrival_s,
            e2e_s=t - a.arrival_s,
            deferred_s=0.0,  # the deferred work runs at the first token, not timed apart
            node=a.request.node,
            prompt_tokens=prompt,
            output_tokens=len(out),
            prefilled_tokens=prompt - (claimed or 0) + a.computed_here,
            reused_tokens=a.reused,
            eligible_tokens=a.eligible,
            reference_tokens=a.reference,
            recomputed_token_layers=a.recomputed,
            kv_bytes=(prompt + len(out)) * self.rt.facts.token_bytes,
            peak_rss_bytes=_peak_rss(),
            segments=a.records,
            first_token_id=a.first_token,
        )
        return RequestResult(record, out, a.materialized, output_kv)

    def _chain(self, a: _Agent, out: list[int], output_kv: SegmentKV | None) -> None:
        """Sources for later agents, as :func:`~kvcmas_bench.workflow.execute` keeps them."""
        if self.plain:
            for seg in a.request.segments:
                if seg.kind == "PH":
                    self.produced.setdefault(seg.slot, []).append(self.index)
            if out:
                self.produced.setdefault(out_slot(a.node), []).append(self.index)
        for slot, kv in a.materialized.items():
            self.store.setdefault(slot, []).append((self.index, kv))
        if output_kv is not None:
            output_kv.slot = out_slot(a.node)
            self.store.setdefault(out_slot(a.node), []).append((self.index, output_kv))
        self.outputs[a.node.id] = out


def _peak_rss() -> int:
    from ...memory import peak_rss

    return peak_rss()


def kv_request(rt: Runtime, ids: tuple[int, ...]) -> tuple[EngineRequest, Capture]:
    """A prefill-only request whose K/V (positions 0..) is captured: a context-free reference or
    an agent's system prompt."""
    k, v = rt.facts.empty(len(ids))
    cap = Capture(0, k, v)
    return EngineRequest(rt.key("kv"), list(ids), 1, Plan(captures=[cap]), kind="kv"), cap
