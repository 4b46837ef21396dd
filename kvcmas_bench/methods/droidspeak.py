"""DroidSpeak (Liu et al. 2026): layer-selective recomputation of a reused segment, in contiguous
layer groups profiled offline, entering each group with the source's hidden states."""

from __future__ import annotations

import torch

from ..engine import SegmentContext
from ..errors import BenchError, OptionError
from ..ops.selection import choose_layer_groups, n_selected_layers, profile_layer_deviation
from ..segments import SegmentKV
from .base import Method, check, register, state
from .cacheblend import reuse_as_is


def source_hidden(ctx: SegmentContext, layers) -> dict[int, torch.Tensor]:
    """The source segment's residual stream ``[S, hidden]`` entering each of ``layers`` it kept."""
    src = ctx.source
    out: dict[int, torch.Tensor] = {}
    if src is None:
        return out
    for li in layers:
        h = src.hidden.get(li)
        if h is not None and h.shape[0] == ctx.length:
            out[li] = h.to(device=ctx.engine.device, dtype=ctx.engine.dtype)
    return out


def calibration_profile(observations: list, n_layers: int) -> torch.Tensor:
    """Mean per-layer relative deviation (K + V) of aligned source vs exact over the observations."""
    sourced = [o for o in observations if o.source is not None]
    if not sourced:
        raise BenchError("calibration produced no observations (no shared segment with a source)")
    return profile_layer_deviation(((o.source, o.exact) for o in sourced), n_layers)


@register
class DroidSpeak(Method):
    """Layer-selective recomputation in contiguous layer groups chosen by offline profiling.

    Calibration: per layer, ``||K_exact - K_src||_F / ||K_exact||_F + (same for V)`` between the
    exact target cache and the RoPE-aligned source cache, averaged over the calibration
    observations (``layer_deviation``). Grouping rule: the layers to recompute number
    ``round_half_up((1 - rho) * L)``; an exact dynamic program chooses at most ``max_groups``
    disjoint contiguous runs of that total length with the largest summed deviation
    (``max_groups=1``, the default: the best sliding window; ``None``: top layers merged into runs).
    One group is the default because every group costs a kept hidden state (``S x hidden`` bytes)
    and, with one model for source and target, its first layer is not corrected (see the note).

    At reuse, for a segment with a source: the aligned source K/V is written into the cache, then for
    each group ``[a, b)`` all segment tokens are pushed through layers ``a..b-1``, entering with the
    source's residual stream of the segment at layer ``a`` (``source.hidden[a]``; layer 0 enters
    from the embeddings). Outside the groups the aligned source K/V stays. If the source lacks a
    needed hidden state, the segment is recomputed from its embeddings through layers
    ``0..b-1`` (b the end of the last group lacking it) and counted in full; those rows are then
    the recomputed ones.

    Hidden states: the source run keeps them for the group starts (dense materialization calls
    ``ctx.dense(keep_hidden=group starts)``; agent outputs keep them through
    ``decode_hidden_layers``); their bytes count in ``SegmentKV.nbytes``. A recomputed segment
    carries the source's hidden states forward (the target's own where the fallback computed them)
    so that it can serve as the next edge's source.

    Note (same model for source and target): K/V of a group's first layer ``a`` are a function of
    the hidden state entering ``a`` only, so entering with the source's hidden reproduces the aligned
    source K/V in that layer; a group of w layers corrects its last w - 1 layers.

    Before calibration (no groups), or with ``round((1 - rho) * L) == 0``, it behaves as FullShared.
    With groups covering every layer it equals dense prefill.
    """

    name = "droidspeak"
    label, order, color = "DroidSpeak", 40, "C7"
    summary = "recompute all tokens in profiled contiguous layer groups from the source's hidden states"
    needs_model_internals = True
    needs_source_hidden = True
    needs_calibration = True

    rho: float = 0.9
    max_groups: int | None = 1
    #: calibrated state: recomputed layer groups [(a, b), ...] (recorded in the run config)
    groups: tuple[tuple[int, int], ...] = state((), init=True)
    #: calibrated per-layer deviation profile (not a field: float noise must not block a resume)
    layer_deviation = ()

    def validate(self) -> None:
        check(0.0 <= self.rho <= 1.0, "rho", f"must lie in [0, 1], got {self.rho}")
        check(
            self.max_groups is None or self.max_groups >= 1,
            "max_groups",
            f"must be >= 1 or none, got {self.max_groups}",
        )
        self.groups = tuple(sorted((int(a), int(b)) for a, b in self.groups))
        for i, (a, b) in enumerate(self.groups):
            check(
                0 <= a < b and not (i and a < self.groups[i - 1][1]),
                "groups",
                f"must be disjoint, non-empty [a, b) layer ranges: {self.groups}",
            )

    @property
    def decode_hidden_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """Group starts whose entering hidden state a source must keep (layer 0 = embeddings)."""
        return tuple(sorted({a for a, _ in self.groups if a > 0}))

    def config(self) -> dict:
        cfg = super().config()
        cfg["groups"] = [list(g) for g in self.groups]  # JSON-equal, so a resumed run matches
        return cfg

    def check_model(self, n_layers: int) -> None:
        if self.groups and self.groups[-1][1] > n_layers:
            raise OptionError(f"layer group {self.groups[-1]} is outside the model's {n_layers} layers", knob="groups")

    def calibrate(self, observations: list, n_layers: int) -> None:
        dev = calibration_profile(observations, n_layers)
        self.layer_deviation = tuple(float(x) for x in dev)
        n = n_selected_layers(self.rho, n_layers)
        self.groups = tuple(choose_layer_groups(dev, n, self.max_groups))

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        starts = self.decode_hidden_layers
        if ctx.source is None:
            return ctx.dense(keep_hidden=starts)
        if not self.groups:
            return reuse_as_is(ctx)
        L = ctx.engine.n_layers
        if self.groups[-1][1] > L:
            raise OptionError(f"layer group {self.groups[-1]} outside the model's {L} layers")
        ctx.write(ctx.aligned_source())
        rows = torch.arange(ctx.length, device=ctx.engine.device)
        hid = source_hidden(ctx, starts)
        missing = [b for a, b in self.groups if a > 0 and a not in hid]
        done = 0
        own: dict[int, torch.Tensor] = {}
        if missing:
            done = max(missing)
            _, own = ctx.forward(ctx.embed(), rows, range(0, done), keep_hidden=[a for a in starts if a < done])
        for a, b in self.groups:
            if b <= done:
                continue
            h = ctx.embed() if a == 0 else hid[a][None]
            ctx.forward(h, rows, range(a, b))
        out = ctx.current("recomputed")
        out.hidden = {a: own.get(a, hid.get(a)) for a in starts if a in own or a in hid}
        return out
