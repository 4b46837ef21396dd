"""Calibration: run held-out samples densely and record, for every shared segment, the exact target
cache next to the aligned source cache (segments with a source) and, for context-free-reference
methods, the reference prefilled alone (every segment, the first agent's included). Methods that
profile offline (GraphFlow, DroidSpeak, RelayCaching) and auto-tau build their state from these
observations. Calibration samples are always disjoint from evaluated ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import SegmentContext
from .errors import BenchError
from .methods.base import Method, state
from .segments import SegmentKV


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


#: how far (in share of gated tokens) the best tau may land from ``--target-reuse``
REUSE_TOLERANCE = 0.05
#: entropies at or below this count as "one-hot" (the degenerate paper gate on real caches)
ONE_HOT_ENTROPY = 1e-3


def accepted_share(entropies: list[tuple[float, int]], tau: float) -> float:
    """Share of the gated tokens whose decision tau accepts (entropy <= tau)."""
    total = sum(n for _, n in entropies)
    return sum(n for h, n in entropies if h <= tau) / total if total else 0.0


def check_reachable(entropies: list[tuple[float, int]], target: float, tau: float, gate: str = "paper") -> None:
    """Raise a one-line :class:`BenchError` when ``target`` is out of reach of a meaningful tau.

    Entropies at most :data:`ONE_HOT_ENTROPY` are one-hot decisions: telling them apart would take a
    tau like 1e-80, which means nothing, so they count as one tie at 0. When they alone exceed the
    target (the paper gate on real caches: raw distances differ by far more than T = 1), every tau in
    [0, 1) accepts at least that share; the error says so. Otherwise the accepted share at the chosen
    ``tau`` must lie within :data:`REUSE_TOLERANCE` of the target (the decisions may jump over it).
    """
    one_hot = accepted_share(entropies, ONE_HOT_ENTROPY)
    if target > 0 and one_hot > target + REUSE_TOLERANCE:
        why = "one-hot softmax over raw distances" if gate == "paper" else "one anchor far closer than the others"
        raise BenchError(
            f"--target-reuse {target:g} is out of reach with gate_mode={gate}: {one_hot:.0%} of the gated tokens of "
            f"calibration have gate entropy ~0 ({why}), so every tau in [0, 1) accepts at least that share"
            + ("; use --method-arg gate_mode=scaled" if gate == "paper" else "")
        )
    best = accepted_share(entropies, tau)
    if abs(best - target) <= REUSE_TOLERANCE:
        return
    below = max([0.0] + [s for s in (accepted_share(entropies, h) for h, _ in entropies) if s < target])
    raise BenchError(
        f"--target-reuse {target:g} is out of reach: the accepted share of the {len(entropies)} gate decisions "
        f"of calibration jumps from {below:.2f} to {best:.2f} (tau {tau:.3g}); use more --calib-samples"
        + ("" if gate == "scaled" else " or --method-arg gate_mode=scaled")
    )


def auto_tau(method, flow_factory, calib: list, target: float):
    """Run calibration units with the gate closed (dense everywhere, pools filling as in a real
    run), record every gate's entropy, and return a fresh method whose tau reaches ``target`` (a
    one-line error when no tau can, see :func:`check_reachable`)."""
    cfg = {k: v for k, v in method.config().items() if k != "name"}
    probe = type(method)(**cfg)
    probe.tau = -1.0  # below every entropy: the gate never accepts
    flow = flow_factory(probe)
    for u in calib:
        flow.run_unit(u)
    tau = tau_for_reuse(probe.entropies, target)
    check_reachable(probe.entropies, target, tau, getattr(method, "gate_mode", "paper"))
    chosen = type(method)(**cfg)
    chosen.tau = tau  # may be -1 (target 0: accept nothing), outside the user-facing range
    return chosen, tau
