"""One home for the settings every job takes, and one way to build them from the command line.

The per-job options dataclasses (``RunOptions``, ``SuiteOptions``, ``AblateOptions``,
``RankOptions``, ``SweepOptions``) are composed from the layers here, so a setting shared by jobs
(model, device, dtype, seed, output path, sample limit, token budgets, method knobs, fidelity,
calibration samples) is declared, defaulted and checked once. :func:`from_cli` builds any of them
from a typer command's parameters (``from_cli(RunOptions, locals())``), as lm-eval's ``from_cli``
builds its evaluator config: a field takes the parameter of its name (or the one its metadata names)
and converts it with the parser its metadata names. :func:`parse_pairs` is the one ``KEY=VALUE``
parser (``--method-arg``, ``--engine-arg``) and :func:`to_type` the one string-to-field-type
converter (method knobs, engine options). No torch import.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Union

from .errors import BenchError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}


def flag_of(name: str) -> str:
    """``final_max_new_tokens`` -> ``--final-max-new-tokens``."""
    return "--" + name.replace("_", "-")


# --- parsers of command-line strings: (flag, value) -> value


def comma_list(flag: str, value: str | None) -> list[str] | None:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``; None (or nothing listed) -> None."""
    items = [s.strip() for s in value.split(",") if s.strip()] if value else []
    return items or None


def comma_items(flag: str, value: str | None) -> list[str]:
    """:func:`comma_list`, but nothing listed is ``[]`` (the job says what is missing)."""
    return comma_list(flag, value) or []


def comma_floats(flag: str, value: str) -> list[float]:
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{flag} takes comma-separated numbers, got {value!r}") from None


def comma_ints(flag: str, value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{flag} takes comma-separated integers, got {value!r}") from None


def parse_pairs(flag: str, items: Sequence[str] | None, wrap: Callable[[str, str], str] | None = None) -> dict:
    """``["a=1", "b-c=x"]`` -> ``{"a": "1", "b_c": "x"}`` (dashes in a key read as underscores; a key
    given twice is an error). ``wrap(value, item)`` may replace each value (the method knobs keep how
    the item was typed)."""
    out: dict[str, str] = {}
    typed: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise BenchError(f"{flag} takes KEY=VALUE, got {item!r}")
        if key in out:
            raise BenchError(f"{flag} {key} is given twice ({typed[key]} and {item.strip()})")
        typed[key] = item.strip()
        out[key] = wrap(value.strip(), item.strip()) if wrap else value.strip()
    return out


#: the method knobs with a typed flag of their own (``--tau``; every other knob: ``--method-arg KEY=VALUE``)
TYPED_KNOBS = ("tau", "rho", "rank", "anchors", "anchor_dtype")


class MethodArg(str):
    """A knob value given as ``--method-arg KEY=VALUE``: the value, remembering the item as the user
    typed it (``check-layer=2``) so that messages name the option that way."""

    item: str
    #: the option it was given with (``--method-arg``; ``ablate --values`` for swept values)
    flag: str

    def __new__(cls, value: str, item: str, flag: str = "--method-arg"):
        obj = super().__new__(cls, value)
        obj.item = item
        obj.flag = flag
        return obj

    def __reduce__(self):
        return (MethodArg, (str(self), self.item, self.flag))

    @property
    def option(self) -> str:
        return f"{self.flag} {self.item}"


def parse_method_args(items: Sequence[str] | None) -> dict[str, str]:
    """``["rank=16", "check-layer=2"]`` -> ``{"rank": "16", "check_layer": "2"}`` (dashes -> underscores;
    each value a :class:`MethodArg` that remembers how it was typed)."""
    return parse_pairs("--method-arg", items, wrap=MethodArg)


def knob_args(method_arg: Sequence[str] | None, **flags) -> dict:
    """The typed knob flags (None = unset) and ``--method-arg KEY=VALUE`` pairs as one dict."""
    unknown = set(flags) - set(TYPED_KNOBS)
    if unknown:
        raise TypeError(f"not a typed knob flag: {', '.join(sorted(unknown))}")
    extra = parse_method_args(method_arg)
    for key, value in flags.items():
        if value is not None and key in extra:
            raise BenchError(f"{flag_of(key)} is given twice (as a flag and as --method-arg)")
    return {**{k: v for k, v in flags.items() if v is not None}, **extra}


def field_type(hint: Any) -> tuple[Any, bool]:
    """The base type of a field's type hint and whether None is allowed (``int | None`` -> int, True)."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args
    return (next((a for a in args if a is not type(None)), hint) if optional else hint), optional


def to_type(text: str, hint: Any, none_words: Sequence[str] = ()) -> Any:
    """A command-line string as the type ``hint`` names: bool (1/0, true/false, yes/no, on/off), int,
    float (not NaN), str; ``none``/``null`` (and ``none_words``) for None where the hint allows it.
    Raises ``ValueError`` for a value of the wrong type and ``TypeError`` for a type the command line
    cannot give; callers turn them into one line naming their option."""
    base, optional = field_type(hint)
    low = text.strip().lower()
    if optional and (low in _NONE or low in none_words):
        return None
    if base is bool:
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise ValueError(text)
    if base is int:
        return int(low)
    if base is float:
        v = float(low)
        if math.isnan(v):
            raise ValueError(text)
        return v
    if base is str:
        return text.strip()
    raise TypeError(f"{hint} cannot be set from the command line")


def cli(
    default: Any = MISSING,
    *,
    source: str | None = None,
    parse: Callable | None = None,
    flag: str | None = None,
    factory: Any = MISSING,
):
    """A settings field that :func:`from_cli` fills from the command parameter ``source`` (default:
    the field's name), converted by ``parse(flag, value)`` (``flag``: how messages name the option,
    default ``--source``); a parsed None keeps the default."""
    meta = {"source": source, "parse": parse, "flag": flag}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def from_cli(cls: type, params: Mapping[str, Any], **given: Any):
    """``cls`` (a settings dataclass) built from a typer command's parameters: every field from the
    parameter of its name or its ``source``, parsed as its metadata says; ``method_args`` from the
    typed knob flags and ``--method-arg``; ``given`` as is."""
    kw: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in given or not f.init:
            continue
        if f.name == "method_args" and "method_arg" in params:
            knobs = {k: params[k] for k in TYPED_KNOBS if k in params}
            kw[f.name] = knob_args(params["method_arg"], **knobs)
            continue
        source = f.metadata.get("source") or f.name
        if source not in params:
            continue
        value = params[source]
        parse = f.metadata.get("parse")
        if parse is not None and value is not None:
            value = parse(f.metadata.get("flag") or flag_of(source), value)
        if value is None and (f.default is not MISSING or f.default_factory is not MISSING):
            continue
        kw[f.name] = value
    return cls(**kw, **given)


def derive(cls: type, source: Any, layer: type, **overrides: Any):
    """``cls`` built from the fields of ``layer`` that ``source`` holds, then ``overrides`` (a suite
    or ablation cell's ``RunOptions`` from the job's own settings)."""
    return cls(**{**{f.name: getattr(source, f.name) for f in fields(layer)}, **overrides})


def check_positive(**values: int | None) -> None:
    """One ``BenchError`` line for the first value (by keyword = field name) below 1; None is unset."""
    for name, v in values.items():
        if v is not None and v < 1:
            raise BenchError(f"{flag_of(name)} must be a positive integer, got {v}")


#: engines that run workload samples (``run``, ``suite``, ``ablate``)
EVAL_ENGINES = ("in-process", "vllm")


# --- the layers


@dataclass(kw_only=True)
class ModelSettings:
    """What every job that loads a model takes."""

    #: HF model id, local HF folder or .gguf file (None: the default model, SmolLM2-135M-Instruct)
    model: str | None = None
    #: cpu, cuda, cuda:N or auto
    device: str = "auto"
    #: float32, bfloat16 or float16
    dtype: str = "float32"
    #: seed of the sample subset and order (serve-sweep: of the traces)
    seed: int = 0
    #: output directory; a job run again into it resumes
    output_path: str = "runs/latest"


@dataclass(kw_only=True)
class SampleSettings(ModelSettings):
    """A job over workload samples: how many, and the token budgets of the agents."""

    #: samples per workload (a seeded subset, the same for every method; None: all)
    limit: int | None = None
    #: max new tokens per task agent (None: the workload's)
    max_new_tokens: int | None = None
    #: max new tokens of the final agent (None: the workload's)
    final_max_new_tokens: int | None = None

    def check_samples(self) -> None:
        check_positive(
            limit=self.limit, max_new_tokens=self.max_new_tokens, final_max_new_tokens=self.final_max_new_tokens
        )


@dataclass(kw_only=True)
class MethodSettings:
    """A job that runs methods: their knobs (typed flags and ``--method-arg`` pairs; None = unset),
    resolved and checked by :func:`kvcmas_bench.methods.resolve_methods` before any model loads."""

    method_args: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class EvalSettings(SampleSettings, MethodSettings):
    """A job that runs methods over workload samples (``run``, ``suite``, ``ablate``)."""

    #: also compute exact dense caches/logits and record the KV error, top-1 agreement and KL
    fidelity: bool = False
    #: held-out samples for calibration
    calib_samples: int = 4
    #: run HumanEval even where the sandbox cannot keep generated code from reading the user's files
    unsafe_sandbox: bool = False
    #: held-out samples run through the method before the measured ones (online state filled),
    #: excluded from every figure
    warmup: int = 0
    #: write every request's rendered prompt text to prompts.jsonl (lm-eval's sample logs)
    log_prompts: bool = False
    #: what runs the samples: "in-process" (one request at a time, exact per-segment fidelity) or
    #: "vllm" (a vLLM deployment with KVCMASConnector, samples batched by vLLM)
    engine: str = "in-process"
    #: engine options (``--engine-arg KEY=VALUE``: base_url of a running server, tensor_parallel_size, ...)
    engine_args: dict = cli(source="engine_arg", parse=parse_pairs, factory=dict)
    #: samples in flight at once (``--engine vllm``)
    max_concurrency: int = 1

    def check_eval(self) -> None:
        self.check_samples()
        check_positive(max_concurrency=self.max_concurrency)
        if self.engine not in EVAL_ENGINES:
            raise BenchError(f"--engine must be one of {', '.join(EVAL_ENGINES)} for samples, got {self.engine!r}")
        if self.engine == "in-process" and (self.engine_args or self.max_concurrency != 1):
            flag = "--engine-arg" if self.engine_args else "--max-concurrency"
            raise BenchError(f"{flag} applies to --engine vllm; the in-process engine runs one request at a time")
        if self.calib_samples < 1:
            raise BenchError(f"--calib-samples must be a positive integer, got {self.calib_samples}")
        if self.warmup < 0:
            raise BenchError(f"--warmup must be a whole number >= 0, got {self.warmup}")
