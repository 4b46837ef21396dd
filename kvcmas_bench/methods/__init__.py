"""Sharing methods; importing this package registers them all in ``METHODS``.

Adding a method: one file in this package (a registered dataclass, see :mod:`.base`) and its name
in the import line below.
"""

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
    "parse_method_args",
    "resolve_method",
    "resolve_methods",
]


def get_method(name: str, **kwargs) -> Method:
    """A fresh instance of method ``name`` with the given knob values (validated)."""
    return method_class(name)(**kwargs)
