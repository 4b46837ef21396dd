"""Method options from the command line: the one resolution path of ``run``, ``serve-sweep``,
``coverage`` and every later job.

The CLI keeps typed flags for the common knobs (``--tau --rank --anchors --rho --anchor-dtype``,
declared once in :mod:`kvcmas_bench.options`) and takes any other knob as ``--method-arg KEY=VALUE``
(repeatable); ``ablate`` converts its swept values with the same :func:`convert`. Both land in one dict of
knob values; :func:`resolve_methods` checks every key against the selected methods' dataclass
fields, converts strings to the field's type, applies workload defaults, and builds one instance
per method (so each method's own ``validate`` runs) before any model is loaded. A key no selected
method has is an error, never silently dropped.
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

from ..errors import BenchError, OptionError
from .base import METHODS, Method

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}


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
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise BenchError(f"--method-arg takes KEY=VALUE, got {item!r}")
        if key in out:
            raise BenchError(f"--method-arg {key} is given twice ({out[key].item} and {item.strip()})")
        out[key] = MethodArg(value.strip(), item.strip())
    return out


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _label(key: str, value) -> str:
    """The option as the user gave it: ``--method-arg check-layer=x`` or the typed flag ``--tau``."""
    return value.option if isinstance(value, MethodArg) else _flag(key)


def _relabel(message: str, args: Mapping[str, object]) -> str:
    """A method's own validation message with the options given as ``--method-arg`` named that way
    (methods name a knob ``--rank`` or ``check_layer``)."""
    for key, value in args.items():
        if not isinstance(value, MethodArg):
            continue
        flag = re.compile(rf"(?<![\w-]){re.escape(_flag(key))}(?![\w-])")
        if flag.search(message):
            message = flag.sub(lambda _m, v=value: v.option, message)
        elif re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", message):
            message += f" (given as {value.option})"
    return message


def _field_type(cls: type[Method], key: str) -> tuple[type, bool]:
    """The base type of ``cls``'s field ``key`` and whether None is allowed."""
    hint = typing.get_type_hints(cls)[key]
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args
    return (next((a for a in args if a is not type(None)), hint) if optional else hint), optional


def expected(cls: type[Method], key: str) -> str:
    """What a value of knob ``key`` must be, in words (``an integer, full or none``)."""
    base, optional = _field_type(cls, key)
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(base, str(base))
    nones = [w for w in (cls.none_words.get(key), "none" if optional else None) if w]
    return ", ".join([kind, *nones[:-1]]) + (f" or {nones[-1]}" if nones else "")


def convert(cls: type[Method], key: str, value):
    """A knob value converted to the type of ``cls``'s field ``key`` (strings from the CLI: ``none``
    for None, and the method's own word for it, ``rank=full``)."""
    base, optional = _field_type(cls, key)
    if not isinstance(value, str):
        return value
    label = _label(key, value)
    text = value.strip()
    if optional and (text.lower() in _NONE or text.lower() == cls.none_words.get(key)):
        return None
    try:
        if base is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            v = float(text)
            if math.isnan(v):
                raise OptionError(f"{label}: option {key!r} of method {cls.name!r} must be a number, got {text!r}")
            return v
        if base is str:
            return text
    except ValueError:
        raise OptionError(
            f"{label}: option {key!r} of method {cls.name!r} must be {expected(cls, key)}, got {text!r}"
        ) from None
    raise OptionError(f"{label}: option {key!r} of method {cls.name!r} cannot be set from the command line")


def method_class(name: str) -> type[Method]:
    """The registered class of method ``name`` (one ``BenchError`` line when there is none)."""
    return METHODS.lookup(name)


def resolve_methods(
    names: Sequence[str], args: Mapping[str, object] | None = None, workload=None
) -> dict[str, MethodSpec]:
    """Validate ``args`` (knob -> value; None = unset) for ``names`` and return a factory of fresh,
    validated instances per method.

    With one method every key must be one of its knobs. With several, a key applies to the
    methods that have it and must apply to at least one. Workload defaults (tau) come first, user
    values override them. Each method is built once here, so invalid values fail before any work.
    """
    args = {k: v for k, v in (args or {}).items() if v is not None}
    classes = {n: method_class(n) for n in names}
    for key, value in args.items():
        owners = [n for n, cls in classes.items() if key in cls.knobs()]
        if not owners:
            which = f"method {names[0]!r}" if len(names) == 1 else f"any of the methods {', '.join(names)}"
            known = ", ".join(sorted({k for cls in classes.values() for k in cls.knobs()})) or "none"
            if isinstance(value, MethodArg):
                raise OptionError(
                    f"{value.option}: unknown method option {key!r} for {which} (options: {known}; "
                    "see `kvcmas-bench methods --options`)"
                )
            raise OptionError(f"{_flag(key)} does not apply to {which} (options: {known})")
    factories: dict[str, MethodSpec] = {}
    for name, cls in classes.items():
        kw = dict(cls.workload_defaults(workload)) if workload is not None else {}
        kw.update({k: convert(cls, k, v) for k, v in args.items() if k in cls.knobs()})
        try:
            cls(**kw)
        except OptionError as exc:
            raise OptionError(f"method {name!r}: {_relabel(str(exc), args)}") from None
        factories[name] = MethodSpec(cls, kw)
    return factories


def resolve_method(name: str, args: Mapping[str, object] | None = None, workload=None) -> MethodSpec:
    return resolve_methods([name], args, workload)[name]


@dataclass(frozen=True)
class MethodSpec:
    """A validated method choice: calling it builds a fresh instance (fresh pools, no calibration)."""

    cls: type[Method]
    kwargs: dict

    @property
    def name(self) -> str:
        return self.cls.name

    def __call__(self, **overrides) -> Method:
        return self.cls(**{**self.kwargs, **overrides})


def expand_methods(methods: Sequence[str]) -> list[str]:
    """Method names with ``all`` expanded (NonShared and FullShared first), duplicates dropped."""
    if not methods:
        raise BenchError("no methods given (use a comma-separated list or 'all')")
    public = METHODS.names()
    every = [n for n in ("nonshared", "fullshared") if n in METHODS] + [
        n for n in public if n not in ("nonshared", "fullshared")
    ]
    out: list[str] = []
    for m in methods:
        for n in every if m == "all" else [m]:
            method_class(n)
            if n not in out:
                out.append(n)
    return out
