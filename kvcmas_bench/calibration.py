"""Calibration: run held-out samples densely and record, for every shared segment, the exact target
cache next to the aligned source cache (segments with a source) and, for context-free-reference
methods, the reference prefilled alone (every segment, the first agent's included). Methods that
profile offline (GraphFlow, DroidSpeak, RelayCaching) and auto-tau build their state from these
observations. Calibration samples are always disjoint from evaluated ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import SegmentContext, SegmentKV
from .errors import BenchError
from .methods.base import Method, state


@dataclass
class Observation:
    """One shared segment of a calibration run. ``consumer`` is the workflow node that consumed it
    (role + position: what relations and anchors are keyed by); ``source`` is None for segments
    without one (recorded only when the reference is)."""

    slot: str
    agent: str
    source_agent: str
    start: int
    source: SegmentKV | None
    exact: SegmentKV
    reference: SegmentKV | None = None
    inv_freq: torch.Tensor | None = None
    consumer: str = ""


@dataclass
class Recorder(Method):
    """Dense prefill everywhere (NonShared behaviour) while recording observations."""

    name = "_recorder"
    with_reference: bool = False
    observations: list[Observation] = state(default_factory=list)

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        kv = ctx.dense()
        if ctx.source is None and not self.with_reference:
            return kv
        ref = (
            ctx.engine.prefill_alone(ctx.segment.ids, slot=ctx.slot, embeds=ctx.segment.embeds)
            if self.with_reference
            else None
        )
        self.observations.append(
            Observation(
                slot=ctx.slot,
                agent=ctx.agent,
                source_agent=(ctx.source.agent or "") if ctx.source is not None else "",
                start=ctx.start,
                source=ctx.aligned_source() if ctx.source is not None else None,
                exact=kv,
                reference=ref,
                inv_freq=ctx.engine.inv_freq,
                consumer=ctx.consumer,
            )
        )
        return kv


def collect(flow_factory, units, with_reference: bool = False) -> list[Observation]:
    """Run ``units`` (samples or serving trajectories) through the flow ``flow_factory(method)``
    builds, with a :class:`Recorder` as the method: the one calibration collector of every job."""
    rec = Recorder(with_reference=with_reference)
    flow = flow_factory(rec)
    for u in units:
        flow.run_unit(u)
    return rec.observations


@dataclass
class ImportanceRecorder(Recorder):
    """A Recorder that also records each segment's attention importance at ``check_layer``: the
    attention mass the segment's own queries place on each of its tokens in the exact target run
    (RelayCaching's criterion; the following agent-specific tokens are not prefilled yet)."""

    name = "_importance_recorder"
    check_layer: int = 1
    importance: list = state(default_factory=list)

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        from .ops.selection import attention_mass

        if ctx.source is None:
            return ctx.dense()
        got: dict = {}

        def probe(layer, q, K, mask, scaling):
            if layer == self.check_layer:
                got["att"] = attention_mass(q, K, mask, scaling, ctx.start, ctx.start + ctx.length)

        ctx.forward(ctx.embed(), range(ctx.length), range(ctx.engine.n_layers), attn_probe=probe, count=False)
        kv = ctx.current("exact")
        ctx.prefilled += ctx.length
        self.observations.append(
            Observation(
                slot=ctx.slot,
                agent=ctx.agent,
                source_agent=ctx.source.agent or "",
                start=ctx.start,
                source=ctx.aligned_source(),
                exact=kv,
                inv_freq=ctx.engine.inv_freq,
                consumer=ctx.consumer,
            )
        )
        self.importance.append(got.get("att"))
        return kv


def tau_for_reuse(entropies: list[tuple[float, int]], target: float) -> float:
    """Smallest tau whose accepted gate decisions cover ``target`` of the gated tokens."""
    if not entropies:
        raise BenchError("--target-reuse: calibration produced no gate decisions (too few samples?)")
    total = sum(n for _, n in entropies)
    acc = 0
    tau = -1.0
    for h, n in sorted(entropies):
        if acc / total >= target:
            break
        acc += n
        tau = h
    return tau


def auto_tau(method, flow_factory, calib: list, target: float):
    """Run calibration units with the gate closed (dense everywhere, pools filling as in a real
    run), record every gate's entropy, and return a fresh method whose tau reaches ``target``."""
    cfg = {k: v for k, v in method.config().items() if k != "name"}
    probe = type(method)(**cfg)
    probe.tau = -1.0  # below every entropy: the gate never accepts
    flow = flow_factory(probe)
    for u in calib:
        flow.run_unit(u)
    tau = tau_for_reuse(probe.entropies, target)
    chosen = type(method)(**cfg)
    chosen.tau = tau  # may be -1 (target 0: accept nothing), outside the user-facing range
    return chosen, tau
