"""One registry for every plugin kind (sharing methods, workloads, serving engines): register by
name, look up with one message for an unknown name, and views of values derived from the
registered classes (labels, colours, table order) that follow registrations made later."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from .errors import BenchError

T = TypeVar("T")
V = TypeVar("V")


class Registry(dict, Generic[T]):
    """Name -> registered class or factory of one ``kind``: a plain dict (registration order;
    ``pop`` unregisters). Names starting with ``_`` are hidden: registered, but neither listed by
    :meth:`names` nor accepted by :meth:`lookup`."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, obj: T | None = None, *, name: str | None = None):
        """Register ``obj`` under ``name`` (default: its ``name`` attribute); usable bare
        (``@reg.register``) or with a name (``@reg.register(name="x")``). Returns ``obj``."""

        def deco(o: T) -> T:
            self[name if name is not None else o.name] = o
            return o

        return deco if obj is None else deco(obj)

    def names(self) -> list[str]:
        """The public names, in registration order."""
        return [n for n in self if not n.startswith("_")]

    def lookup(self, name: str) -> T:
        """The entry ``name``, or one ``BenchError`` line naming the choices."""
        if name.startswith("_") or name not in self:
            raise BenchError(f"unknown {self.kind} {name!r}; use one of {', '.join(sorted(self.names()))}")
        return self[name]


class LiveMapping(Mapping[str, V], Generic[V]):
    """A read-only mapping recomputed by ``fn()`` on every access, so that it follows the registry
    (a method registered after import, by a plugin or a test, shows up)."""

    def __init__(self, fn: Callable[[], Mapping[str, V]]):
        self._fn = fn

    def __getitem__(self, key: str) -> V:
        return self._fn()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fn())

    def __len__(self) -> int:
        return len(self._fn())

    def __repr__(self) -> str:
        return repr(dict(self._fn()))


class LiveSequence(Sequence[V], Generic[V]):
    """A read-only sequence recomputed by ``fn()`` on every access (see :class:`LiveMapping`)."""

    def __init__(self, fn: Callable[[], Sequence[V]]):
        self._fn = fn

    def __getitem__(self, i):
        return self._fn()[i]

    def __iter__(self) -> Iterator[V]:
        return iter(self._fn())

    def __len__(self) -> int:
        return len(self._fn())

    def __repr__(self) -> str:
        return repr(tuple(self._fn()))
