"""``--engine-arg KEY=VALUE`` parsing of the vLLM engines, driven by an options dataclass's fields:
one parser for :class:`~.inprocess.VLLMOptions` (``--engine vllm-inprocess``) and
:class:`~.http.ServerOptions` (``--engine vllm``). No vLLM import."""

from __future__ import annotations

from dataclasses import fields
from typing import TypeVar

from ...errors import BenchError
from ...settings import to_type

T = TypeVar("T")


def parse_engine_options(cls: type[T], options: dict, engine: str = "vllm") -> T:
    """``cls(**options)`` with every value converted to its field's type (``-`` in a key read as
    ``_``; a ``str`` field keeps a string as given), then checked: every integer field positive
    (None allowed where the field is optional), every float field positive and finite,
    ``gpu_memory_utilization`` in (0, 1]. One
    ``BenchError`` line for an unknown key, a value of the wrong type or out of range."""
    known = {f.name: f for f in fields(cls)}
    out = {}
    for key, value in options.items():
        key = key.replace("-", "_")
        if key not in known:
            raise BenchError(f"unknown --engine-arg {key!r} for --engine {engine}; known: {', '.join(known)}")
        typ = str(known[key].type)
        out[key] = value if "str" in typ and isinstance(value, str) else convert_option(key, value, typ)
    opts = cls(**out)
    for f in fields(cls):
        v = getattr(opts, f.name)
        if "int" in str(f.type) and v is not None and v < 1:
            raise BenchError(f"--engine-arg {f.name} must be a positive integer, got {v}")
        if "float" in str(f.type) and v is not None and not (0 < v < float("inf")):
            raise BenchError(f"--engine-arg {f.name} must be a positive number, got {v}")
    if "gpu_memory_utilization" in known and not 0 < opts.gpu_memory_utilization <= 1:
        raise BenchError(f"--engine-arg gpu_memory_utilization must lie in (0, 1], got {opts.gpu_memory_utilization}")
    return opts


def convert_option(key: str, value, typ: str):
    """A ``--engine-arg`` string as the field type ``typ`` names (bool, int, float, optional:
    ``none``/``null``; :func:`kvcmas_bench.settings.to_type`); a value that is not a string is kept."""
    if not isinstance(value, str):
        return value
    base = bool if "bool" in typ else float if "float" in typ else int
    try:
        return to_type(value, base | None if "None" in typ else base)
    except ValueError:
        raise BenchError(f"--engine-arg {key}={value!r} is not a valid {typ}") from None
