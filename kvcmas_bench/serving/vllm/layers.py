"""Partial forwards on the model vLLM serves, for the methods that recompute chosen tokens layer by
layer (CacheBlend), as LMCache's blender does: the worker runs vLLM's own modules (norms, fused
QKV projection, rotary, output projection, MLP) over a per-request cache, with the attention step
of the in-process engine (:class:`~kvcmas_bench.segments.CacheRows`).

- **Where the model comes from.** vLLM hands a KV connector its paged caches, not the model. The
  model is the live ``*ForCausalLM`` module whose attention layers are the ones in vLLM's static
  forward context, looked up once when the caches are registered (before vLLM's engine core
  freezes its startup heap, which hides those objects from :func:`gc.get_objects`; a lookup after
  the freeze unfreezes the heap for the scan and freezes it again).
- **Which models.** Llama-style decoder layers (``LlamaForCausalLM``, ``MistralForCausalLM``,
  ``Qwen2ForCausalLM``): pre-norm attention over ``qkv_proj`` with neox rotary, then a pre-norm MLP.
  Other architectures are refused by name (their layers may hold more, e.g. per-head norms).
- **One rank.** Under tensor parallelism every projection ends in a collective, which the method
  thread cannot issue beside the engine's; refused.
- **Serialized with the engine.** vLLM's CPU kernels keep per-primitive state (oneDNN handles and
  scratch buffers), so the method thread runs one layer at a time under :data:`MODEL_LOCK`, which
  the connector holds across each engine step (:mod:`.connector`). A request being planned waits
  at most one engine step per layer; the engine waits at most one layer of a partial forward.
  On CPU the method thread computes with ``OMP_NUM_THREADS`` intra-op threads, unbound, while
  vLLM's engine thread has the cores it bound at start (vLLM forbids changing a thread count after
  its binding), so a partial forward there runs on fewer cores than the engine's forward.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterable, Sequence

import torch

from ...engine import Engine
from ...errors import BenchError
from ...segments import CacheRows, KVCache

#: decoder layers whose forward is exactly ``run_layers`` below
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

#: held by the engine thread across each engine step and by a partial forward for each layer
MODEL_LOCK = threading.Lock()


def find_model(vllm_config) -> torch.nn.Module | None:
    """The model this worker serves: the causal LM whose attention modules are vLLM's forward
    context's (None: not found)."""
    attn = {id(m) for m in vllm_config.compilation_config.static_forward_context.values()}
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    try:
        for o in gc.get_objects():
            if not type(o).__name__.endswith("ForCausalLM") or not isinstance(o, torch.nn.Module):
                continue
            layers = getattr(getattr(o, "model", None), "layers", None)
            if layers is not None and len(layers) and id(getattr(layers[0].self_attn, "attn", None)) in attn:
                return o
        return None
    finally:
        if frozen:
            gc.freeze()


class ModelLayers:
    """What a :class:`~kvcmas_bench.engine.SegmentContext` asks of an engine (embeddings, dense
    prefill, partial forwards over a :class:`~kvcmas_bench.segments.KVCache`), on vLLM's modules."""

    def __init__(self, model: torch.nn.Module, facts):
        name = type(model).__name__
        if name not in SUPPORTED:
            raise BenchError(
                f"partial forwards on vLLM support {', '.join(SUPPORTED)} decoder layers; the served model is {name}"
            )
        if facts.shards is not None and facts.shards.world > 1:
            raise BenchError("partial forwards on vLLM run on one rank (tensor_parallel_size=1)")
        base = model.model
        self.layers = base.layers
        self.embed = base.embed_tokens
        self.n_layers, self.n_kv, self.head_dim = facts.n_layers, facts.n_kv, facts.head_dim
        self.inv_freq = facts.inv_freq
        self.device, self.dtype = facts.device, facts.dtype

    new_cache = Engine.new_cache
    prefill = Engine.prefill
    prefill_alone = Engine.prefill_alone

    def embed_ids(self, ids: Sequence[int]) -> torch.Tensor:
        with MODEL_LOCK:
            return self.embed(torch.as_tensor(list(ids), device=self.device))[None]

    @torch.no_grad()
    def run_layers(
        self,
        cache: KVCache,
        h: torch.Tensor,
        positions: torch.Tensor,
        layers: Sequence[int] | range | None = None,
        keep_hidden: Iterable[int] = (),
        attn_probe=None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`kvcmas_bench.engine.Engine.run_layers` on vLLM's modules (hidden states ``[1, T, hidden]``)."""
        layers = range(self.n_layers) if layers is None else layers
        keep = set(keep_hidden)
        kept: dict[int, torch.Tensor] = {}
        positions = positions.to(self.device)
        rows = CacheRows(positions)
        T, D = positions.numel(), self.head_dim
        x = h[0]
        for li in layers:
            layer = self.layers[li]
            attn = layer.self_attn
            if li in keep:
                kept[li] = x.clone()
            with MODEL_LOCK:
                qkv, _ = attn.qkv_proj(layer.input_layernorm(x))
                q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
                q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
                q, k, v = (t.reshape(T, -1, D).transpose(0, 1)[None] for t in (q, k, v))
                out = rows.attend(cache, li, q, k, v, attn.scaling, attn_probe)
                out, _ = attn.o_proj(out[0].transpose(0, 1).reshape(T, -1))
                x = x + out
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.length = max(cache.length, rows.kmax)
        return x[None], kept


class LazyLayers:
    """The served model, found when made (:func:`find_model`); its :class:`ModelLayers` made on
    first use, so a model they do not support fails the plans that need them, not the server."""

    def __init__(self, vllm_config, facts):
        self._config, self._facts = vllm_config, facts
        self._model = find_model(vllm_config)
        self._layers: ModelLayers | None = None

    def __call__(self) -> ModelLayers:
        if self._layers is None:
            if self._model is None:
                self._model = find_model(self._config)
            if self._model is None:
                raise BenchError("partial forwards on vLLM: the served model was not found in the worker process")
            self._layers = ModelLayers(self._model, self._facts)
        return self._layers
