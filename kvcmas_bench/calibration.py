"""Calibration: run held-out samples densely and record, for every shared segment that has a
source, the aligned source cache next to the exact target cache (and optionally the context-free
reference). Methods that profile offline (GraphFlow, DroidSpeak, RelayCaching) and auto-tau build
their state from these observations. Calibration samples are always disjoint from evaluated ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .engine import SegmentContext, SegmentKV
from .methods.base import Method


@dataclass
class Observation:
    slot: str
    agent: str
    source_agent: str
    start: int
    source: SegmentKV
    exact: SegmentKV
    reference: SegmentKV | None = None
    inv_freq: torch.Tensor | None = None


@dataclass
class Recorder(Method):
    """Dense prefill everywhere (NonShared behaviour) while recording observations."""

    name = "_recorder"
    with_reference: bool = False
    observations: list[Observation] = field(default_factory=list)

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        kv = ctx.dense()
        if ctx.source is not None:
            ref = (ctx.engine.prefill_alone(ctx.segment.ids, slot=ctx.slot, embeds=ctx.segment.embeds)
                   if self.with_reference else None)
            self.observations.append(Observation(
                slot=ctx.slot, agent=ctx.agent, source_agent=ctx.source.agent or "", start=ctx.start,
                source=ctx.aligned_source(), exact=kv, reference=ref, inv_freq=ctx.engine.inv_freq))
        return kv


def collect(flow_factory, samples, with_reference: bool = False) -> list[Observation]:
    """Run ``samples`` through a workflow built by ``flow_factory(method)`` with a Recorder."""
    rec = Recorder(with_reference=with_reference)
    flow = flow_factory(rec)
    for s in samples:
        flow.run_sample(s)
    return rec.observations


@dataclass
class ImportanceRecorder(Recorder):
    """A Recorder that also records each segment's attention importance at ``check_layer``: the
    attention mass the segment's own queries place on each of its tokens in the exact target run
    (RelayCaching's criterion; the following agent-specific tokens are not prefilled yet)."""

    name = "_importance_recorder"
    check_layer: int = 1
    importance: list = field(default_factory=list)

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        from .methods.selection import attention_mass

        if ctx.source is None:
            return ctx.dense()
        got: dict = {}

        def probe(layer, q, K, mask, scaling):
            if layer == self.check_layer:
                got["att"] = attention_mass(q, K, mask, scaling, ctx.start, ctx.start + ctx.length)

        ctx.forward(ctx.embed(), range(ctx.length), range(ctx.engine.n_layers), attn_probe=probe, count=False)
        kv = ctx.current("exact")
        ctx.prefilled += ctx.length
        self.observations.append(Observation(
            slot=ctx.slot, agent=ctx.agent, source_agent=ctx.source.agent or "", start=ctx.start,
            source=ctx.aligned_source(), exact=kv, inv_freq=ctx.engine.inv_freq))
        self.importance.append(got.get("att"))
        return kv
