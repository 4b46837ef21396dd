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

import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import BenchError, OptionError
from ..settings import TYPED_KNOBS, field_type, flag_of, to_type
from ..settings import MethodArg as MethodArg  # the command line's knob values, read here
from ..settings import parse_method_args as parse_method_args
from .base import METHODS, Method


def _label(key: str, value) -> str:
    """The option as the user gave it: ``--method-arg check-layer=x`` or the typed flag ``--tau``."""
    return value.option if isinstance(value, MethodArg) else flag_of(key)


def _named(exc: OptionError, args: Mapping[str, object]) -> str:
    """A method's validation message with its knob named the way the user gave it: the typed flag
    (``--tau must ...``), the ``--method-arg`` item, or the knob's name."""
    knob = exc.knob
    if knob is None:
        return exc.text
    value = args.get(knob)
    if isinstance(value, MethodArg):
        if knob in TYPED_KNOBS:
            return f"{value.option} {exc.text}"
        return f"{knob} {exc.text} (given as {value.option})"
    return f"{flag_of(knob) if knob in TYPED_KNOBS else knob} {exc.text}"


def _field_type(cls: type[Method], key: str) -> tuple[type, bool]:
    """The base type of ``cls``'s field ``key`` and whether None is allowed."""
    return field_type(typing.get_type_hints(cls)[key])


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
    nones = [cls.none_words[key]] if key in cls.none_words else []
    try:
        return to_type(text, base | None if optional else base, nones)
    except ValueError:
        if base is float and text.lower() == "nan":
            raise OptionError(
                f"{label}: option {key!r} of method {cls.name!r} must be a number, got {text!r}"
            ) from None
        raise OptionError(
            f"{label}: option {key!r} of method {cls.name!r} must be {expected(cls, key)}, got {text!r}"
        ) from None
    except TypeError:
        raise OptionError(
            f"{label}: option {key!r} of method {cls.name!r} cannot be set from the command line"
        ) from None


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
            raise OptionError(f"{flag_of(key)} does not apply to {which} (options: {known})")
    factories: dict[str, MethodSpec] = {}
    for name, cls in classes.items():
        kw = dict(cls.workload_defaults(workload)) if workload is not None else {}
        kw.update({k: convert(cls, k, v) for k, v in args.items() if k in cls.knobs()})
        try:
            cls(**kw)
        except OptionError as exc:
            raise OptionError(f"method {name!r}: {_named(exc, args)}") from None
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
