"""RelayCaching (Geng et al. 2026): token selection by KV deviation x attention importance, with
recomputation restricted to a profiled critical range of middle layers."""

from __future__ import annotations

import torch

from ..engine import SegmentContext
from ..errors import OptionError
from ..ops.selection import (
    attention_mass,
    choose_layer_groups,
    n_selected_layers,
    n_tokens_in_range,
    normalize,
    token_deviation,
    top_tokens,
)
from ..segments import SegmentKV
from .base import Method, check, register, state
from .cacheblend import reuse_as_is
from .droidspeak import calibration_profile, source_hidden


@register
class RelayCaching(Method):
    """Deviation x attention token selection, recomputed only inside a critical layer range.

    Calibration: the per-layer deviation profile of DroidSpeak (relative K + V deviation of the
    aligned source vs the exact cache, mean over observations). The critical range ``[a, b)`` is
    the contiguous window of ``round_half_up(range_fraction * L)`` layers (at least 1) with the
    largest summed deviation, searched only among the middle layers ``1..L-2`` (layer 0 is exact
    after re-alignment and the last layer is excluded as in the paper's "middle layers"); models
    with fewer than 3 layers get no range (FullShared behaviour). ``range_fraction`` is this
    harness's parameter: the paper fixes the range by profiling but gives no width rule.

    At reuse, for a segment of S tokens with a source (otherwise: dense prefill keeping the hidden
    state the next edge needs):

    1. the aligned source K/V is written into the cache; all S tokens are recomputed from their
       embeddings through layers ``0..check_layer`` (the scoring pass, counted as recomputation);
    2. token score ``normalize(dev) * normalize(att)``: ``dev_t`` is CacheBlend's
       ``sum((k_new - k_old)^2)`` at the check layer, ``att_t`` the attention probability mass that
       the segment's own queries place on token t at the check layer (summed over heads and
       queries). The paper also counts the following agent-specific tokens' queries; those are not
       prefilled yet when the segment is materialized, so only the segment's own queries are used;
    3. the top ``n = ceil((1 - rho) * S * L / (b - a))`` tokens (capped at S) are selected, so that
       the recomputed (token, layer) entries inside the range equal ``(1 - rho) * S * L``;
    4. the selected tokens are recomputed only through the range. If the range starts beyond
       ``check_layer + 1`` they enter at ``a`` with the source's hidden states for their rows
       (``source.hidden[a]``: kept by the source's dense prefill, or, for agent outputs, by the
       producer's decode phase via ``decode_hidden_layers``); when the source lacks them they
       continue from the scoring pass's hidden state through ``check_layer+1..b-1`` (counted). If the
       range starts at or before ``check_layer + 1`` they simply continue from the scoring pass
       (layers of the range up to the check layer are already recomputed for every token).

    All other entries keep the aligned source K/V, except layers ``0..check_layer``, which the
    scoring pass recomputed for every token. The effective rho is therefore lower than nominal by
    ``(check_layer + 1) / L`` at most. With a zero budget (rho = 1) nothing is recomputed
    (FullShared); with rho = 0 and a range covering layers ``check_layer+1..L-1`` it equals dense
    prefill. A recomputed segment carries the source's hidden state forward for the next edge.
    """

    name = "relaycaching"
    label, order, color = "RelayCaching", 50, "C8"
    summary = "deviation x attention token selection recomputed in a profiled middle-layer range"
    needs_model_internals = True
    needs_source_hidden = True
    needs_calibration = True

    rho: float = 0.9
    check_layer: int = 1
    range_fraction: float = 0.5
    #: calibrated state: critical layer range [a, b) (recorded in the run config)
    critical: tuple[int, int] | None = state(None, init=True)
    #: calibrated per-layer deviation profile (not a field: float noise must not block a resume)
    layer_deviation = ()

    def validate(self) -> None:
        check(0.0 <= self.rho <= 1.0, "rho", f"must lie in [0, 1], got {self.rho}")
        check(self.check_layer >= 0, "check_layer", f"must be >= 0, got {self.check_layer}")
        check(0.0 < self.range_fraction <= 1.0, "range_fraction", f"must lie in (0, 1], got {self.range_fraction}")
        if self.critical is not None:
            a, b = (int(x) for x in self.critical)
            check(0 <= a < b, "critical", f"must be a layer range [a, b) with 0 <= a < b, got {self.critical}")
            self.critical = (a, b)

    def check_model(self, n_layers: int) -> None:
        if self.check_layer >= n_layers:
            raise OptionError(
                f"{self.check_layer} is outside the model's {n_layers} layers (0..{n_layers - 1})", knob="check_layer"
            )
        if self.critical is not None and self.critical[1] > n_layers:
            raise OptionError(f"{self.critical} is outside the model's {n_layers} layers", knob="critical")

    @property
    def entry_layer(self) -> int | None:
        """The layer at which selected tokens enter the range with the source's hidden state."""
        if self.critical is None or self.critical[0] <= self.check_layer + 1:
            return None
        return self.critical[0]

    @property
    def decode_hidden_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return () if self.entry_layer is None else (self.entry_layer,)

    def config(self) -> dict:
        cfg = super().config()
        cfg["critical"] = None if self.critical is None else list(self.critical)
        return cfg

    def calibrate(self, observations: list, n_layers: int) -> None:
        dev = calibration_profile(observations, n_layers)
        self.layer_deviation = tuple(float(x) for x in dev)
        if n_layers < 3:
            self.critical = None
            return
        width = min(n_layers - 2, max(1, n_selected_layers(1.0 - self.range_fraction, n_layers)))
        ((a, b),) = choose_layer_groups(dev, width, max_groups=1, lo=1, hi=n_layers - 1)
        self.critical = (a, b)

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        keep = self.decode_hidden_layers
        if ctx.source is None:
            return ctx.dense(keep_hidden=keep)
        if self.critical is None:
            return reuse_as_is(ctx)
        S, L, c = ctx.length, ctx.engine.n_layers, self.check_layer
        a, b = self.critical
        if b > L or c >= L:
            raise OptionError(f"critical range {self.critical} / check layer {c} outside {L} layers")
        n = n_tokens_in_range(self.rho, S, L, b - a)
        if n == 0:
            return reuse_as_is(ctx)
        old = ctx.aligned_source()
        ctx.write(old)
        start = ctx.start
        att: dict[str, torch.Tensor] = {}

        def probe(li, q, K, mask, scaling):
            if li == c:
                att["mass"] = attention_mass(q, K, mask, scaling, start, start + S)

        rows = torch.arange(S, device=ctx.engine.device)
        h, _ = ctx.forward(ctx.embed(), rows, range(0, c + 1), attn_probe=probe)
        dev = token_deviation(ctx.cache.k[c, :, start : start + S], old.k[c])
        score = normalize(dev) * normalize(att["mass"].to(dev.device))
        sel = top_tokens(score, n).to(ctx.engine.device)
        hid = source_hidden(ctx, keep)
        if b > c + 1:
            if self.entry_layer is not None and self.entry_layer in hid:
                ctx.forward(hid[a][sel][None], sel, range(a, b))
            else:
                ctx.forward(h[:, sel], sel, range(c + 1, b))
        out = ctx.current("recomputed")
        out.hidden = dict(hid)
        return out
