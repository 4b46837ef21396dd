"""FullShared: reuse the RoPE-aligned source cache of every PH segment, no correction (rho = 1)."""

from __future__ import annotations

from ..engine import SegmentContext
from ..segments import SegmentKV
from .base import Method, register


@register
class FullShared(Method):
    name = "fullshared"
    label, order, color = "FullShared", 20, "C1"
    summary = "reuse the aligned source cache as is (fastest, least accurate)"

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        if ctx.source is None or ctx.forced == "dense":
            return ctx.dense()
        kv = ctx.aligned_source()
        kv.status = "reused"
        kv.hidden = {}
        return kv
