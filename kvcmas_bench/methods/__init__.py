"""Sharing methods; importing this package registers them all in ``METHODS``.

Adding a method: one file in this package (a registered dataclass, see :mod:`.base`) and its name
in the import line below. Tables and figures take its place, name and colour from its class
(:func:`method_order`, :func:`method_labels`, :func:`method_colors`).
"""

import re

from . import cacheblend, droidspeak, fullshared, graphflow, kvcmas, kvcomm, nonshared, relaycaching  # noqa: F401
from .base import METHODS, Method, register
from .knobs import MethodSpec, expand_methods, method_class, parse_method_args, resolve_method, resolve_methods

__all__ = [
    "METHODS",
    "Method",
    "MethodSpec",
    "register",
    "get_method",
    "expand_methods",
    "method_class",
    "method_order",
    "method_labels",
    "method_colors",
    "chain_labels",
    "parse_method_args",
    "resolve_method",
    "resolve_methods",
]


def get_method(name: str, **kwargs) -> Method:
    """A fresh instance of method ``name`` with the given knob values (validated)."""
    return method_class(name)(**kwargs)


def _own(cls: type[Method], attr: str):
    """The class's own ``attr`` (display attributes are not inherited: a registered subclass is
    another method, with its own place, name and colour)."""
    return vars(cls).get(attr, vars(Method)[attr])


def method_order() -> tuple[str, ...]:
    """The public method names in table order: by ``order``, then unordered ones as registered."""
    names = METHODS.names()
    rank = {n: i for i, n in enumerate(names)}

    def key(n: str):
        o = _own(METHODS[n], "order")
        return (o is None, 0 if o is None else o, rank[n])

    return tuple(sorted(names, key=key))


def method_labels() -> dict[str, str]:
    """Method name -> display name (``label``, else the name), in table order."""
    return {n: _own(METHODS[n], "label") or n for n in method_order()}


def method_colors() -> dict[str, str]:
    """Method name -> matplotlib colour, the same in every figure: the class's ``color``, else
    the next ``C<i>`` after the highest one taken, in table order (deterministic)."""
    own = {n: _own(METHODS[n], "color") for n in method_order()}
    taken = [int(m.group(1)) for c in own.values() if (m := re.fullmatch(r"C(\d+)", c or ""))]
    free = max(taken, default=-1) + 1
    out = {}
    for n, c in own.items():
        if not c:
            c, free = f"C{free}", free + 1
        out[n] = c
    return out


def chain_labels() -> dict[str, str]:
    """Method name -> its line's name in the chained vs non-chained figure, for the methods drawn
    there, in registration order (the order of the figure's lines)."""
    return {n: c for n in METHODS.names() if (c := _own(METHODS[n], "chain_label"))}
