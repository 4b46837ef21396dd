"""CacheBlend (Yao et al. 2025; LMCache ``lmcache/v1/compute/blend/blender.py``): token-selective
recomputation of a reused segment."""

from __future__ import annotations

import torch

from ..engine import SegmentContext
from ..errors import OptionError
from ..ops.selection import n_selected_tokens, token_deviation, top_tokens
from ..segments import KVCache, SegmentKV
from .base import Method, PromptPiece, check, register


def reuse_as_is(ctx: SegmentContext) -> SegmentKV:
    """FullShared's result: the aligned source cache, no correction, no hidden states."""
    kv = ctx.aligned_source()
    kv.status = "reused"
    kv.hidden = {}
    return kv


@register
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

    A whole prompt (:meth:`materialize_prompt`, the vLLM server's worker) runs the same steps for
    every segment at once, layer by layer, as LMCache's blender does: private segments and shared
    ones without a source are computed at every layer beside them. Every row depends only on rows
    before it and on the layer below, so this equals materializing the segments one by one.
    """

    name = "cacheblend"
    label, order, color = "CacheBlend", 30, "C6"
    summary = "recompute all tokens to a check layer, then only the top-deviation tokens (CacheBlend)"
    needs_model_internals = True

    rho: float = 0.9
    check_layer: int = 1
    score_on: str = "k"

    def validate(self) -> None:
        check(0.0 <= self.rho <= 1.0, "rho", f"must lie in [0, 1], got {self.rho}")
        check(self.check_layer >= 0, "check_layer", f"must be >= 0, got {self.check_layer}")
        check(self.score_on in ("k", "v"), "score_on", f"must be 'k' or 'v', got {self.score_on!r}")

    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        if ctx.source is None:
            return ctx.dense()
        if n_selected_tokens(self.rho, ctx.length) == 0:
            self._check_layer(ctx.engine.n_layers)
            return reuse_as_is(ctx)
        piece = PromptPiece(ctx.start, ctx.embed(), ctx.aligned_source())
        self.materialize_prompt(ctx.engine, ctx.cache, [piece])
        ctx.recomputed_token_layers += piece.recomputed_token_layers
        return ctx.current(piece.status)

    def materialize_prompt(self, engine, cache: KVCache, pieces: list[PromptPiece]) -> None:
        """Steps 1-4 for every piece with ``old`` (the others computed at every layer), in two
        forwards over all of them: layers ``0..check_layer`` for every row, then the rows kept
        (the selected ones and those of the computed pieces) through the layers above."""
        L, c = engine.n_layers, self.check_layer
        self._check_layer(L)
        work: list[tuple[PromptPiece, int | None]] = []
        for p in pieces:
            n = None if p.old is None else n_selected_tokens(self.rho, p.length)
            if p.old is not None:
                cache.write(p.old)
                p.status = "reused" if n == 0 else "recomputed"
            if n != 0:
                work.append((p, n))
        if not work:
            return
        dev = engine.device
        pos = torch.cat([torch.arange(p.start, p.start + p.length, device=dev) for p, _ in work])
        h, _ = engine.run_layers(cache, torch.cat([p.x for p, _ in work], dim=1), pos, range(0, c + 1))
        store = cache.k if self.score_on == "k" else cache.v
        keep, off = [], 0
        for p, n in work:
            rows = torch.arange(off, off + p.length, device=dev)
            if n is not None:
                old = (p.old.k if self.score_on == "k" else p.old.v)[c]
                score = token_deviation(store[c, :, p.start : p.start + p.length], old)
                rows = rows[top_tokens(score, n).to(dev)]
                p.recomputed_token_layers = p.length * (c + 1) + n * (L - c - 1)
            keep.append(rows)
            off += p.length
        if c + 1 < L:
            rows = torch.cat(keep)
            engine.run_layers(cache, h[:, rows], pos[rows], range(c + 1, L))

    def check_model(self, n_layers: int) -> None:
        self._check_layer(n_layers)

    def _check_layer(self, n_layers: int) -> None:
        if self.check_layer >= n_layers:
            raise OptionError(
                f"{self.check_layer} is outside the model's {n_layers} layers (0..{n_layers - 1})", knob="check_layer"
            )
