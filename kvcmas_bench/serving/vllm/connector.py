"""The vLLM v1 KV connector of kvcmas-bench: puts the harness's shared-segment KV into vLLM's paged
cache and copies the KV the harness needs back out.

vLLM loads it from ``KVTransferConfig(kv_connector="KVCMASConnector",
kv_connector_module_path="kvcmas_bench.serving.vllm.connector", kv_role="kv_both")`` and builds two
instances, one per role. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
both instances and the harness share :data:`STORE`: before adding a request the harness registers a
:class:`Plan` under a key and passes the key as ``SamplingParams(extra_args={"kv_transfer_params":
{"kvcmas_key": key}})``.

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .layout import KVLayout, slots_at, slots_of
from .plan import KEY, STORE, Capture, Plan  # noqa: F401  (Capture, Plan: re-exported for callers)


@dataclass
class _Step:
    key: str
    block_ids: list[int]
    start: int  # first position computed in this step
    n: int  # positions computed in this step
    inject: tuple[int, int] | None = None


@dataclass
class KVCMASMeta(KVConnectorMetadata):
    steps: list[_Step] = field(default_factory=list)


def _key(request) -> str | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    key = params.get(KEY)
    return key if key in STORE.plans else None


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
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        key = _key(request)
        if key is None:
            return 0, False
        n = min(STORE.plans[key].prefix_len, request.num_prompt_tokens - 1)
        return max(0, n - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        key = _key(request)
        if key is None:
            return
        self._keys[request.request_id] = key
        STORE.claimed[key] = num_external_tokens
        if num_external_tokens > 0:
            self._inject[request.request_id] = num_external_tokens

    def _step(self, req_id: str, start: int, n: int) -> _Step:
        key = self._keys[req_id]
        ext = self._inject.pop(req_id, 0)
        if STORE.record_steps:
            STORE.steps.setdefault(key, []).append((start, n))
        return _Step(key, list(self._blocks[req_id]), start, n, (start - ext, start) if ext else None)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVCMASMeta()
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
        self._drop(request.request_id)
        return False, None

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)
        self._index = {name: _layer_index(name, i) for i, name in enumerate(kv_caches)}

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
        return lay

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Called before every forward pass: prepare this step's overrides (slots and rows)."""
        super().bind_connector_metadata(connector_metadata)
        self._overrides = []
        for st in getattr(connector_metadata, "steps", ()):
            plan = STORE.plans.get(st.key)
            for s, k, v in plan.overrides if plan is not None else ():
                a, b = max(s, st.start), min(s + k.shape[2], st.start + st.n)
                if a < b:
                    slots = slots_of(st.block_ids, a, b, self.block_size)
                    self._overrides.append((slots, k[:, :, a - s : b - s], v[:, :, a - s : b - s]))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Write planned prefixes (synchronous loads: vLLM calls this before the forward pass)."""
        for st in self._get_connector_metadata().steps:
            plan = STORE.plans.get(st.key)
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
        meta = self._get_connector_metadata()
        self._overrides = []
        for st in meta.steps:
            plan = STORE.plans.get(st.key)
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
