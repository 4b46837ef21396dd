"""GraphFlow (Li et al. 2026a) as the representative preconstructed-correction method.

Non-chained, no online matching. Calibration on held-out samples stores, for every recurring
relation (slot, consuming agent j), the mean per-position correction

    Delta_j[t] = mean over calibration segments covering t of (C_j - align(C_ref))[t]

(keys in canonical coordinates) up to the longest calibrated length, where C_ref is the segment
prefilled with no agent prefix. At run time the context-free reference of each first-seen segment
is prefilled once (its time counts in the TTFT of the request waiting for it) and

    C_hat_j = align(C_ref) + Delta_j   on the calibrated rows, the plain reference beyond,

always applied (rho = 1: every shared segment is eligible, the first agent's included). A relation
is (slot, consuming workflow node); calibration covers every relation it serves, the first agent's
included (its segment has no source, only the reference). A relation never seen in calibration
reuses the reference unchanged and is recorded as ``uncalibrated``, never as ``corrected``.
"""

from __future__ import annotations

import torch

from ..engine import SegmentContext
from ..ops.kvmath import shift_keys
from ..ops.lowrank import canonical_keys
from ..segments import SegmentKV
from .base import Method, register, state


@register
class GraphFlow(Method):
    name = "graphflow"
    label, order, color = "GraphFlow", 60, "C5"
    summary = "calibrated per-(slot, consumer) mean corrections on a context-free reference"
    needs_calibration = True
    calibration_reference = True
    reuse_from = "reference"
    calibrated_state = ("corrections",)
    corrections: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = state(default_factory=dict)
    references: dict[tuple, SegmentKV] = state(default_factory=dict)
    stats: dict[str, int] = state(default_factory=dict)

    def config(self) -> dict:
        return {"name": self.name, "relations": sorted(f"{s}->{a}" for s, a in self.corrections)}

    def calibrate(self, observations: list, n_layers: int) -> None:
        sums: dict[tuple[str, str], list[torch.Tensor]] = {}
        for ob in observations:
            if ob.reference is None:
                raise ValueError("GraphFlow calibration needs the context-free reference of every observation")
            dk = canonical_keys(ob.exact.k, ob.exact.start, ob.inv_freq).float() - ob.reference.k.float()
            dv = ob.exact.v.float() - ob.reference.v.float()
            S = dk.shape[2]
            acc = sums.get((ob.slot, ob.consumer))
            if acc is None or acc[0].shape[2] < S:
                acc = [
                    _grow(acc[0] if acc else None, dk, S),
                    _grow(acc[1] if acc else None, dv, S),
                    _grow(acc[2] if acc else None, torch.zeros(S, device=dk.device), S),
                ]
                sums[(ob.slot, ob.consumer)] = acc
            acc[0][:, :, :S] += dk
            acc[1][:, :, :S] += dv
            acc[2][:S] += 1
        self.corrections = {
            rel: (k / c[None, None, :, None], v / c[None, None, :, None]) for rel, (k, v, c) in sums.items()
        }

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        if ctx.forced == "dense":  # a controlled reuse ratio: this transition falls back
            ctx.details["schedule"] = "dense"
            return ctx.dense()
        key = (ctx.slot, tuple(ctx.segment.ids))
        ref = self.references.get(key)
        if ref is None:
            ref = ctx.reference()
            self.references = {k: v for k, v in self.references.items() if k[0] != ctx.slot}
            self.references[key] = ref
        k, v = ref.k.clone(), ref.v.clone()
        corr = self.corrections.get((ctx.slot, ctx.consumer))
        status = "uncalibrated"
        if corr is not None:
            n = min(ctx.length, corr[0].shape[2])
            k[:, :, :n] += corr[0][:, :, :n].to(k.dtype)
            v[:, :, :n] += corr[1][:, :, :n].to(v.dtype)
            status = "corrected"
            ctx.details["calibrated_tokens"] = n
        self._count(status)
        return SegmentKV(
            k=shift_keys(k, ctx.start, ctx.engine.inv_freq),
            v=v,
            start=ctx.start,
            ids=tuple(ctx.segment.ids),
            status=status,
        )

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def state_bytes(self) -> int:
        n = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.corrections.values())
        return n + sum(r.nbytes for r in self.references.values())


def _grow(t: torch.Tensor | None, like: torch.Tensor, S: int) -> torch.Tensor:
    """Zero tensor shaped like ``like`` with ``S`` rows on the token axis, holding ``t``'s rows."""
    axis = like.ndim - 2 if like.ndim > 1 else 0
    shape = list(like.shape)
    shape[axis] = S
    out = torch.zeros(shape, dtype=torch.float32, device=like.device)
    if t is not None:
        out.narrow(axis, 0, t.shape[axis]).copy_(t)
    return out
