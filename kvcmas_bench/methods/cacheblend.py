"""CacheBlend (Yao et al. 2025; LMCache ``lmcache/v1/compute/blend/blender.py``): token-selective
recomputation of a reused segment."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import SegmentContext, SegmentKV
from ..errors import OptionError
from ..ops.selection import n_selected_tokens, token_deviation, top_tokens
from .base import Method, check, register


def reuse_as_is(ctx: SegmentContext) -> SegmentKV:
    """FullShared's result: the aligned source cache, no correction, no hidden states."""
    kv = ctx.aligned_source()
    kv.status = "reused"
    kv.hidden = {}
    return kv


@register
@dataclass
class CacheBlend(Method):
    """Token-selective recomputation by KV deviation at a check layer.

    For a PH segment of S tokens with a source (otherwise: dense prefill):

    1. the RoPE-aligned source K/V ("old") is written into the request cache;
    2. all S tokens are recomputed from their embeddings through layers ``0..check_layer`` (their
       queries attend causally over the exact prefix and the segment as it stands);
    3. at ``check_layer`` each token is scored by ``sum((k_new - k_old)^2)`` over heads and dims
       (``score_on="v"`` uses values), ``k_new`` read from the cache after step 2;
    4. the top ``ceil((1 - rho) * S)`` tokens (LMCache's ratio) continue from their hidden state
       leaving ``check_layer`` through layers ``check_layer+1..L-1``: their K/V overwrite the old
       rows, every other row of those layers keeps the aligned source K/V.

    The segment therefore has recomputed rows in every layer ``<= check_layer`` and, above, only in
    the selected rows. With every token selected (rho = 0) this is dense prefill. With a zero token
    budget (rho = 1) the check pass is skipped and the result is FullShared's (nothing recomputed).

    Reuse ratio: the engine counts ``S * (check_layer + 1) + n * (L - check_layer - 1)``
    recomputed (token, layer) entries, so the effective rho (entries not recomputed / all shared
    entries) is lower than the nominal ``rho``: e.g. rho = 0.9, check layer 1, L = 30 gives an
    effective rho of about 0.84.
    """

    name = "cacheblend"
    label, order, color = "CacheBlend", 30, "C6"
    summary = "recompute all tokens to a check layer, then only the top-deviation tokens (CacheBlend)"
    needs_model_internals = True

    rho: float = 0.9
    check_layer: int = 1
    score_on: str = "k"

    def validate(self) -> None:
        check(0.0 <= self.rho <= 1.0, f"--rho must lie in [0, 1], got {self.rho}")
        check(self.check_layer >= 0, f"check_layer must be >= 0, got {self.check_layer}")
        check(self.score_on in ("k", "v"), f"score_on must be 'k' or 'v', got {self.score_on!r}")

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        if ctx.source is None:
            return ctx.dense()
        S, L, c = ctx.length, ctx.engine.n_layers, self.check_layer
        if c >= L:
            raise OptionError(f"check_layer {c} outside the model's {L} layers")
        n = n_selected_tokens(self.rho, S)
        if n == 0:
            return reuse_as_is(ctx)
        old = ctx.aligned_source()
        ctx.write(old)
        rows = torch.arange(S, device=ctx.engine.device)
        h, _ = ctx.forward(ctx.embed(), rows, range(0, c + 1))
        store = ctx.cache.k if self.score_on == "k" else ctx.cache.v
        new = store[c, :, ctx.start : ctx.start + S]
        score = token_deviation(new, (old.k if self.score_on == "k" else old.v)[c])
        sel = top_tokens(score, n).to(ctx.engine.device)
        if c + 1 < L:
            ctx.forward(h[:, sel], sel, range(c + 1, L))
        return ctx.current("recomputed")
