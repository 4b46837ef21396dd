"""The vLLM v1 KV connector of kvcmas-bench: puts shared-segment KV into vLLM's paged cache and
copies the KV the methods need back out.

vLLM loads it from ``KVTransferConfig(kv_connector="KVCMASConnector",
kv_connector_module_path="kvcmas_bench.serving.vllm.connector", kv_role="kv_both")`` and builds two
instances, one per role (scheduler and worker; in separate processes under ``vllm serve``). Plans
reach it in one of two ways:

- **Server** (``vllm serve``, the usual engine-core and worker processes): a request's
  ``kv_transfer_params`` hold the kvcmas metadata (:mod:`.worker`). The scheduler side passes new
  requests to the worker side in the step metadata and answers "not yet" (None) until the worker's
  background thread has planned them with the method (the claim comes back in the worker
  metadata); requests of a method with nothing to plan (NonShared) get 0 at once and run as plain
  requests. Finished requests' outputs travel the same way, and report requests return the
  records in the response's ``kv_transfer_params`` (calibrate requests: the calibration's summary).
- **In-process** (``--engine vllm-inprocess``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the harness,
  both instances and :data:`STORE` share one process; the harness registers a :class:`Plan` under
  a key passed as ``{"kvcmas_key": key}``.

A plan holds, for one request (positions are absolute prompt positions):

- ``prefix``: K/V of positions ``[0, n)``. **Scheduler side**: ``get_num_new_matched_tokens``
  claims them (at most ``prompt_len - 1``: vLLM must compute at least one token), so vLLM schedules
  only the remaining tokens. **Worker side**: ``start_load_kv`` writes them into the request's
  blocks before the forward pass.
- ``overrides``: K/V of later ranges ``[s, s + S)`` (a shared segment after agent-specific tokens,
  which a prefix claim cannot reach). vLLM computes those tokens, and ``wait_for_layer_load``
  overwrites their K/V in every layer after vLLM wrote it and before attention reads it, so the
  tokens after them attend to the provided cache, exactly as the in-process engine prefills
  agent-specific tokens over a reused segment. No compute is saved for overridden tokens.
- ``captures``: ranges whose K/V, as vLLM computed it, is copied into harness buffers in
  ``wait_for_save`` after each step that wrote any of their rows (dense segments, context-free
  references, the agent's own output during decode).

Every step is handled by intersecting these ranges with the tokens the step computes, so chunked
prefill and preemption (re-scheduled requests get their plan applied again) are covered. Memory
access goes through :class:`~.layout.KVLayout`, probed with vLLM's own cache-write op.

**Tensor parallelism** (server mode): every rank's worker has its own runtime on its own KV heads
(the rank's paged cache, so plans, captures, sources and anchors hold that rank's heads); every
rank gets the same step metadata and plans the same requests in the same order; the delta
methods' gate and token weights are summed over the ranks, and each request's outcome is agreed
over the group before rank 0 alone answers the scheduler and keeps the records (:mod:`.tp`).
Pipeline and context parallelism are refused (:func:`~.tp.parallel_refusal`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from .guard import screen_request
from .layers import MODEL_LOCK, LazyLayers
from .layout import KVLayout, slots_at, slots_of
from .plan import KEY, STORE, Capture, Plan  # noqa: F401  (Capture, Plan: re-exported for callers)
from .tp import HeadShards, parallel_refusal
from .worker import ANSWERED_OPS, SESSION_IDLE_S, WorkerRuntime, waits_for_plan

#: seconds the scheduler side holds a request for its plan or answer before it gives up on it
DEADLINE_S = 300.0
#: sessions whose held requests the scheduler side counts between reports (the oldest beyond go)
MAX_SESSIONS_COUNTED = 4096

#: the worker side's runtime (one per worker process)
RUNTIME: WorkerRuntime | None = None


@dataclass
class _Step:
    key: str
    block_ids: list[int]
    start: int  # first position computed in this step
    n: int  # positions computed in this step
    inject: tuple[int, int] | None = None
    server: bool = False


@dataclass
class KVCMASMeta(KVConnectorMetadata):
    steps: list[_Step] = field(default_factory=list)
    #: server mode: requests the worker has not seen (id, metadata, prompt tokens), and finished ones
    new: list[tuple[str, dict, list[int]]] = field(default_factory=list)
    finished: list[tuple[str, list[int]]] = field(default_factory=list)
    #: requests the scheduler side stopped waiting for (deadline): their plans must not be applied
    abandoned: list[str] = field(default_factory=list)


@dataclass
class KVCMASWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: planned claims, report answers, planning errors (rank 0 only)."""

    claims: dict[str, int] = field(default_factory=dict)
    answers: dict[str, list] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other):
        if other is not None:
            self.claims.update(other.claims)
            self.answers.update(other.answers)
            self.errors.update(other.errors)
        return self


def _key(request) -> str | None:
    params = getattr(request, "kv_transfer_params", None)
    key = params.get(KEY) if isinstance(params, dict) else None
    return key if isinstance(key, str) and key in STORE.plans else None


def _layer_index(name: str, fallback: int) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else fallback


class KVCMASConnector(KVConnectorBase_V1):
    """Scheduler side: claims planned prefixes, tracks block ids. Worker side: writes, overrides
    and captures K/V through :class:`~.layout.KVLayout`."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._vllm_config = vllm_config
        # scheduler side
        self._keys: dict[str, str] = {}
        self._blocks: dict[str, list[int]] = {}
        self._inject: dict[str, int] = {}
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._index: dict[str, int] = {}
        self._layouts: dict[str, KVLayout] = {}
        self._overrides: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._model_held = False
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        self._budget = int(float(extra["budget_gib"]) * 2**30) if extra.get("budget_gib") else None
        self._idle_s = float(extra.get("session_idle_s") or SESSION_IDLE_S)
        self._deadline_s = float(extra.get("deadline_s") or DEADLINE_S)
        why = parallel_refusal(vllm_config.parallel_config)
        if why:
            raise ValueError(f"KVCMASConnector cannot run with {why}")
        #: tensor parallelism: each rank's worker plans on its own KV heads (:mod:`.tp`)
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        # scheduler side, server mode
        self._server: set[str] = set()
        self._asked: set[str] = set()
        #: agents whose claim the scheduler waits for, and those it answered "not yet" (None) so far
        self._waits: set[str] = set()
        self._held: set[str] = set()
        #: per session, since its previous report: requests held back for a plan at least once
        self._held_count: dict[str, int] = {}
        self._claims: dict[str, int] = {}
        self._answers: dict[str, list] = {}
        self._errors: dict[str, str] = {}
        self._new: list[tuple[str, dict, list[int]]] = []
        self._finished: list[tuple[str, list[int]]] = []
        #: each request's checked kvcmas metadata (:func:`~.guard.screen_request`, once per request),
        #: the reason a request was refused, and when a held request was first held
        self._meta: dict[str, dict | None] = {}
        self._abandoned: list[str] = []
        self._refused: dict[str, str] = {}
        self._since: dict[str, float] = {}

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        """The worker ledger's figures as vLLM's connector stats (:mod:`.stats`)."""
        from .stats import LedgerStats

        return LedgerStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """The ledger's gauges on ``/metrics`` (:mod:`.stats`)."""
        from .stats import LedgerMetrics

        return LedgerMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self):
        """Worker side, after each step: the ledger's figures when they changed."""
        if RUNTIME is None:
            return None
        figures = RUNTIME.ledger_figures()
        if figures is None:
            return None
        from .stats import LedgerStats

        return LedgerStats(data={str(RUNTIME.rank): figures})

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """Overrides run per layer (``wait_for_layer_load``) between attention pieces."""
        return True

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        rid = request.request_id
        if rid not in self._meta:
            self._meta[rid], why = screen_request(request)
            if why is not None:  # refused before anything is looked up: one token, then the reason
                self._refused[rid] = why
                request.max_tokens = 1
        if rid in self._refused:
            return 0, False
        meta = self._meta[rid]
        if meta is not None:
            return self._server_match(request, meta, num_computed_tokens)
        key = _key(request)
        if key is None:
            return 0, False
        if self._tp > 1:
            raise ValueError(
                "in-process plans (--engine vllm-inprocess) reach one worker process only; "
                "tensor parallelism needs the server mode (--engine vllm)"
            )
        n = min(STORE.plans[key].prefix_len, request.num_prompt_tokens - 1)
        return max(0, n - num_computed_tokens), False

    def _server_match(self, request, meta: dict, num_computed_tokens: int):
        """Server mode: tell the worker once; None ("not yet": the request waits, others step) until
        its plan (an agent of a planning method) or its answer (a report) is in. A request with
        nothing to plan (a capture; an agent of NonShared) claims nothing and goes on at once."""
        rid = request.request_id
        self._server.add(rid)
        if rid not in self._asked:
            self._asked.add(rid)
            self._new.append((rid, meta, list(request.prompt_token_ids)))
            if waits_for_plan(meta):
                self._waits.add(rid)
        op = meta.get("op")
        if op in ANSWERED_OPS:
            return (0, False) if rid in self._answers or self._overdue(rid) else (None, False)
        if rid not in self._waits:
            return 0, False
        if rid not in self._claims and self._overdue(rid):
            self._claims[rid] = 0
            self._errors[rid] = f"TimeoutError: the worker did not plan it within {self._deadline_s:g} s"
            self._abandoned.append(rid)
        if rid not in self._claims:
            if rid not in self._held:
                self._held.add(rid)
                sess = str(meta.get("session"))
                self._held_count[sess] = self._held_count.pop(sess, 0) + 1  # most recent last
                while len(self._held_count) > MAX_SESSIONS_COUNTED:  # sessions that never report
                    self._held_count.pop(next(iter(self._held_count)))
            return None, False
        n = min(self._claims[rid], request.num_prompt_tokens - 1)
        return max(0, n - num_computed_tokens), False

    def _overdue(self, rid: str) -> bool:
        """Whether ``rid`` has been held past the deadline (its request then goes on, with an error)."""
        since = self._since.setdefault(rid, time.monotonic())
        if time.monotonic() - since <= self._deadline_s:
            return False
        self._refused.setdefault(rid, f"TimeoutError: no answer from the worker within {self._deadline_s:g} s")
        return True

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVCMASWorkerMeta):  # answers for requests still here (not given up on)
            self._claims.update({r: v for r, v in meta.claims.items() if r in self._server})
            self._answers.update({r: v for r, v in meta.answers.items() if r in self._server})
            self._errors.update({r: v for r, v in meta.errors.items() if r in self._server})

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if request.request_id in self._server:
            key = request.request_id
        else:
            key = _key(request)
            if key is None:
                return
            STORE.claimed[key] = num_external_tokens
        self._keys[request.request_id] = key
        if num_external_tokens > 0:
            self._inject[request.request_id] = num_external_tokens

    def _step(self, req_id: str, start: int, n: int) -> _Step:
        key = self._keys[req_id]
        ext = self._inject.pop(req_id, 0)
        server = req_id in self._server
        if STORE.record_steps and not server:
            STORE.steps.setdefault(key, []).append((start, n))
        return _Step(key, list(self._blocks[req_id]), start, n, (start - ext, start) if ext else None, server)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVCMASMeta(new=self._new, finished=self._finished, abandoned=self._abandoned)
        self._new, self._finished, self._abandoned = [], [], []
        sched = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            if nr.req_id in self._keys:
                self._blocks[nr.req_id] = list(nr.block_ids[0])
                meta.steps.append(self._step(nr.req_id, nr.num_computed_tokens, sched.get(nr.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._keys:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._blocks[req_id] = list(new[0]) if new else []
            elif new:
                self._blocks[req_id].extend(new[0])
            meta.steps.append(self._step(req_id, cached.num_computed_tokens[i], sched.get(req_id, 0)))
        for req_id in scheduler_output.finished_req_ids:
            self._drop(req_id)
        return meta

    def _drop(self, req_id: str) -> None:
        self._keys.pop(req_id, None)
        self._blocks.pop(req_id, None)
        self._inject.pop(req_id, None)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._drop(rid)
        meta = self._meta.pop(rid, None) or {}
        refused = self._refused.pop(rid, None)
        self._since.pop(rid, None)
        if rid not in self._server:
            return False, ({"kvcmas_error": refused} if refused else None)
        self._server.discard(rid)
        self._asked.discard(rid)
        self._waits.discard(rid)
        self._held.discard(rid)
        self._claims.pop(rid, None)
        error = self._errors.pop(rid, None) or refused
        if meta.get("op") in ANSWERED_OPS and rid not in self._answers and refused:
            return False, {"kvcmas_error": refused}
        if meta.get("op") in ANSWERED_OPS:
            answer = {"kvcmas_reports": self._answers.pop(rid, [])}
            if meta.get("op") == "report":
                held = self._held_count.pop(str(meta.get("session")), 0)
                answer["kvcmas_scheduler"] = {"requests_held_for_plan": held}
            return False, answer
        self._finished.append((rid, list(request.output_token_ids)))
        return False, ({"kvcmas_error": error} if error else None)

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        global RUNTIME
        self._caches = dict(kv_caches)
        self._index = {name: _layer_index(name, i) for i, name in enumerate(kv_caches)}
        if RUNTIME is None and kv_caches:
            RUNTIME = _runtime(self._vllm_config, next(iter(kv_caches.values())).device, self._budget, self._idle_s)

    def _plan(self, st: _Step) -> Plan | None:
        if st.server:
            return RUNTIME.plan_of(st.key) if RUNTIME is not None else None
        return STORE.plans.get(st.key)

    def build_connector_worker_meta(self):
        if RUNTIME is None:
            return None
        claims, answers, errors = RUNTIME.take_answers()
        return KVCMASWorkerMeta(claims, answers, errors) if (claims or answers or errors) else None

    def _layout(self, name: str) -> KVLayout:
        lay = self._layouts.get(name)
        if lay is None:
            cache = self._caches[name]
            shared = next((v for k, v in self._layouts.items() if self._caches[k].shape == cache.shape), None)
            if shared is not None:
                lay = shared
            else:
                layer = self._vllm_config.compilation_config.static_forward_context[name]
                mc = self._vllm_config.model_config
                lay = KVLayout(
                    cache,
                    layer,
                    self.block_size,
                    self.num_blocks or self._vllm_config.cache_config.num_gpu_blocks,
                    mc.get_num_kv_heads(self._vllm_config.parallel_config),
                    mc.get_head_size(),
                )
            self._layouts[name] = lay
            if RUNTIME is not None:
                RUNTIME.kv_access[name] = "strided" if lay.strided else "flat"
        return lay

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Called before every forward pass: prepare this step's overrides (slots and rows). The
        engine step holds :data:`~.layers.MODEL_LOCK` from here to :meth:`wait_for_save`, so the
        method thread's partial forwards never run vLLM's kernels beside the engine's."""
        if not self._model_held:
            MODEL_LOCK.acquire()
            self._model_held = True
        super().bind_connector_metadata(connector_metadata)
        self._overrides = []
        if RUNTIME is not None:  # finished first: a trajectory's next agent may arrive in the same step
            for rid, output in getattr(connector_metadata, "finished", ()):
                RUNTIME.finished(rid, output)
            for rid, meta, prompt in getattr(connector_metadata, "new", ()):
                RUNTIME.new_request(rid, meta, prompt)
            for rid in getattr(connector_metadata, "abandoned", ()):
                RUNTIME.abandon(rid)
        for st in getattr(connector_metadata, "steps", ()):
            plan = self._plan(st)
            for s, k, v in plan.overrides if plan is not None else ():
                a, b = max(s, st.start), min(s + k.shape[2], st.start + st.n)
                if a < b:
                    slots = slots_of(st.block_ids, a, b, self.block_size)
                    self._overrides.append((slots, k[:, :, a - s : b - s], v[:, :, a - s : b - s]))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Write planned prefixes (synchronous loads: vLLM calls this before the forward pass)."""
        for st in self._get_connector_metadata().steps:
            plan = self._plan(st)
            if plan is None or st.inject is None or plan.prefix is None:
                continue
            a, b = st.inject
            slots = slots_of(st.block_ids, a, b, self.block_size)
            pk, pv = plan.prefix
            for name, cache in self._caches.items():
                li = self._index[name]
                self._layout(name).write(cache, slots, pk[li, :, a:b].transpose(0, 1), pv[li, :, a:b].transpose(0, 1))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """This step's K/V of the layer is in the cache; replace overridden rows before attention."""
        if not self._overrides:
            return
        cache, li, lay = self._caches[layer_name], self._index[layer_name], self._layout(layer_name)
        for slots, k, v in self._overrides:
            lay.write(cache, slots, k[li].transpose(0, 1), v[li].transpose(0, 1))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        """After the forward pass: copy captured rows that are in the cache by now (computed in this
        step or an earlier one, or a prefix-cache hit) and not copied yet."""
        try:
            self._save()
        finally:
            if self._model_held:
                self._model_held = False
                MODEL_LOCK.release()

    def _save(self) -> None:
        meta = self._get_connector_metadata()
        self._overrides = []
        for st in meta.steps:
            plan = self._plan(st)
            copied = False
            for cap in plan.captures if plan is not None else ():
                b = min(cap.end, st.start + st.n)
                if b <= cap.start:
                    continue
                rows = (~cap.filled[: b - cap.start]).nonzero().flatten()
                if rows.numel() == 0:
                    continue
                slots = slots_at(st.block_ids, rows + cap.start, self.block_size)
                for name, cache in self._caches.items():
                    li = self._index[name]
                    k, v = self._layout(name).read(cache, slots)
                    cap.k[li, :, rows] = k.transpose(0, 1).to(cap.k.dtype)
                    cap.v[li, :, rows] = v.transpose(0, 1).to(cap.v.dtype)
                cap.filled[rows] = True
                copied = True
            if copied and RUNTIME is not None and cap.k.is_cuda:
                # the copies are queued on the engine's stream; the method thread waits for this event
                event = torch.cuda.Event()
                event.record()
                RUNTIME.step_event = event
            if st.server and RUNTIME is not None:
                RUNTIME.captured(st.key)


def _runtime(vllm_config, device, budget: int | None, idle_s: float = SESSION_IDLE_S) -> WorkerRuntime:
    """The worker's runtime: model facts from vLLM's config, K/V on the cache's device. Under tensor
    parallelism every rank has its own, on its own KV heads (``n_kv`` is the rank's head count)."""
    from .inprocess import eos_ids, model_facts

    mc = vllm_config.model_config
    n_kv = mc.get_num_kv_heads(vllm_config.parallel_config)
    shards = HeadShards.from_vllm(vllm_config)
    facts = model_facts(mc.hf_config, mc.dtype, device, n_kv=n_kv, keep_ready=True, shards=shards)
    if budget is None:
        budget = default_budget(vllm_config, device)
    return WorkerRuntime(facts, eos_ids(mc.hf_config), budget, layers=LazyLayers(vllm_config, facts), idle_s=idle_s)


def default_budget(vllm_config, device) -> int:
    """The worker's byte budget when none is set: a share of the memory vLLM leaves unused. On CUDA
    half of what ``gpu_memory_utilization`` leaves of the device (this K/V sits outside vLLM's own
    accounting); on CPU a quarter of the host memory available now."""
    if getattr(device, "type", str(device)) == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * max(0.0, 1.0 - vllm_config.cache_config.gpu_memory_utilization) / 2)
    import psutil

    return int(psutil.virtual_memory().available / 4)
