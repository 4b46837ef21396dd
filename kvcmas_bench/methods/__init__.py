"""Sharing methods; importing this package registers them all in ``METHODS``."""

from . import cacheblend, droidspeak, fullshared, graphflow, kvcmas, kvcomm, nonshared, relaycaching  # noqa: F401
from .base import METHODS, Method, register

__all__ = ["METHODS", "Method", "register", "get_method"]


def get_method(name: str, **kwargs) -> Method:
    from ..errors import BenchError

    if name not in METHODS:
        raise BenchError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name](**kwargs)
