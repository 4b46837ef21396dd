"""The method interface: one dataclass per method, one override point (``materialize``).

For every shared (PH) segment of a target agent's request, the engine builds a
:class:`~kvcmas_bench.engine.SegmentContext` (the segment, its position, the source agent's
materialized cache of the same slot if any, and handles to ask the engine for a dense prefill,
a context-free reference, or deferred work) and asks the method for the segment's cache. What the
method returns is written into the request's cache and becomes the source of the next edge.
Methods with state (anchor pools, calibration tables) keep it on the dataclass and report its
exact size through ``state_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..engine import SegmentContext, SegmentKV

METHODS: dict[str, type["Method"]] = {}


def register(cls: type["Method"]) -> type["Method"]:
    METHODS[cls.name] = cls
    return cls


@dataclass
class Method:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: offline profiling needed before evaluation (see ``calibrate``)
    needs_calibration: ClassVar[bool] = False
    #: calibration observations should include the context-free reference cache
    calibration_reference: ClassVar[bool] = False
    #: residual-stream layers the engine keeps for agent outputs during decode (as sources)
    decode_hidden_layers: ClassVar[tuple[int, ...]] = ()

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        """Return the cache of ``ctx.segment`` at ``ctx.start``. Default: dense prefill."""
        return ctx.dense()

    def calibrate(self, observations: list, n_layers: int) -> None:
        """Build offline state from :class:`~kvcmas_bench.calibration.Observation` records."""

    def state_bytes(self) -> int:
        """Exact bytes of tensors the method keeps between requests."""
        return 0

    def config(self) -> dict:
        from dataclasses import asdict

        return {"name": self.name, **asdict(self)}
