"""Online delta correction with an anchor pool: the machinery KVCMAS and KVComm share.

For a shared segment of target agent j, the reference cache C_ref (chained: the source agent's
materialized cache C_i; non-chained: a context-free prefill of the segment) is compared with the
anchors of the slot's pool (Eq. 9-11). A reliable match gives

    C_hat_j = align(C_ref) + sum_v w_v Delta_v,j            (Eq. 5 / Eq. 8)

with token-wise weights w (keys and values separately); an unreliable one falls back to dense
prefill, whose exact cache yields a new anchor (Eq. 12) after the first token. Keys are compared,
stored and corrected in canonical (position-0) coordinates and rotated to the target at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..engine import SegmentContext
from ..ops.correction import CorrectionTally, applied_figures, block_ranges, select_terms, weighted_rows
from ..ops.gate import DEFAULT_GATE_TEMPERATURE, GATES, gate_scores, rounded_distances
from ..ops.gate_outcome import GateOutcome, entropy_verdict, gate_route
from ..ops.kvmath import shift_keys
from ..ops.lowrank import (
    FACTORIZATIONS,
    add_shift_into,
    factorization,
    gate_entropy,
    lowrank_apply,
    lowrank_token_sqdist,
    operand_rows,
    rows_copy,
    shift_to_rows,
    sparse_apply,
    token_weights,
)
from ..segments import SegmentKV
from .anchors import Anchor, AnchorPool, FactorStack, instance_key, total_layout
from .base import Method, check, state

#: ``anchor_dtype`` values besides None (the model's dtype); the CLI's ``--anchor-dtype`` help lists
#: the same (``options.ANCHOR_DTYPES``, a module that imports no method; tests/test_options.py ties them)
ANCHOR_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class GateDecision:
    anchors: list[Anchor]
    k: int
    weights: torch.Tensor
    entropy: float | None
    sqdist_v: torch.Tensor | None = None


@dataclass
class _CorrectionPlan:
    """One correction's fixed inputs: the context, the gate's decision, the reference, the factor
    stacks (``part -> (bases, deltas)``), the keys' frame of positions and the output rows."""

    ctx: SegmentContext
    dec: GateDecision
    ref: SegmentKV
    stacks: dict[str, tuple[FactorStack, FactorStack]]
    #: the positions the keys are compared and corrected at: the reference's for low-rank key
    #: factors (their ``B`` rotated there), canonical (0) for full-dimensional ones
    frame: int
    out: dict[str, torch.Tensor]

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.ctx.engine.inv_freq

    def reference_block(self, part: str, start: int, n: int) -> torch.Tensor:
        """The reference's rows ``start .. start + n`` of ``part``, keys moved to :attr:`frame`."""
        ref = self.ref
        x = (ref.k if part == "k" else ref.v)[:, :, start : start + n]
        if part == "k" and self.frame != ref.start:
            x = shift_keys(x.float(), self.frame - ref.start, self.inv_freq)
        return x

    def gate_sqdist(self, part: str, start: int, n: int) -> torch.Tensor | None:
        """The gate's (reduced) squared value distances of the block, reused for V's weights."""
        sq = self.dec.sqdist_v
        return sq[:, start : start + n] if part == "v" and sq is not None else None

    def shift(self, part: str) -> int:
        """Positions the corrected rows of ``part`` move on: keys from :attr:`frame` to the segment's."""
        return self.ctx.start - self.frame if part == "k" else 0


@dataclass
class OnlineDeltaCorrection(Method):
    """Shared by KVCMAS (low-rank, chained) and KVComm (full-dimensional, non-chained)."""

    anchors: int = 10
    tau: float = 0.3
    rank: int | None = 32
    temperature: float = 1.0
    chained: bool = True
    exact_layer0: bool = False
    activation_top_p: float = 0.9
    #: storage/GEMM dtype of anchor states: None = the model's dtype; "bfloat16" halves their
    #: memory and runs the gate/weight/apply GEMMs in bf16 (reductions stay in float32)
    anchor_dtype: str | None = field(default=None, metadata={"choices": (None, *ANCHOR_DTYPES)})
    #: anchor factorization: "gram" (top eigenvectors of the per-layer Gram matrix: the exact
    #: truncated SVD at a fraction of its cost), "exact" (a full SVD of every layer), "subspace"
    #: (subspace iteration on the Gram matrix: GEMMs only; docs/methods.md gives its measured error),
    #: "auto" (gram on the CPU, subspace on a GPU, where a batched eigh is latency-bound)
    svd: str = field(default="auto", metadata={"choices": FACTORIZATIONS})
    #: gate scores (``ops/gate.py``): "paper" = raw distances, softmax T = 1 (Eq. 9-10); "scaled" =
    #: relative excess distance over the closest anchor, in units of ``gate_temperature``
    gate_mode: str = field(default="paper", metadata={"choices": GATES})
    #: scaled gate: the relative distance gap that weighs e times less (two anchors 1% apart: entropy 0.84)
    gate_temperature: float = DEFAULT_GATE_TEMPERATURE
    #: rank r_D of the stored deltas (None: ``rank``); ``rank`` is r_C, the rank of the base caches
    delta_rank: int | None = None
    #: skip the (anchor, token) terms of the correction whose token weight is below this (K and V
    #: apart): the result differs from the unpruned one by at most the dropped weight mass (recorded
    #: per segment as ``dropped_weight``) times the dropped deltas' magnitude; 0 applies every term
    prune_tol: float = 1e-4
    #: gate and correct with only the anchors covering the whole segment (KVCOMM's public code);
    #: False: the paper's variable-length rule (A.3; :func:`~kvcmas_bench.ops.gate_outcome.gate_route`:
    #: k = min(S, the second-longest stored length), the anchors at least k long, their first k rows)
    full_coverage: ClassVar[bool] = False
    pools: dict[str, AnchorPool] = state(default_factory=dict)
    stats: dict[str, int] = state(default_factory=dict)
    entropies: list[tuple[float, int]] = state(default_factory=list)
    references: dict[tuple, SegmentKV] = state(default_factory=dict)

    max_references: ClassVar[int] = 16
    #: rows per block of the gate's distances and of the correction: a block's temporaries
    #: (``[layers, block, sum of ranks]``, a few MB) stay in the CPU caches and are reused by the
    #: allocator from block to block, where whole-segment ones (hundreds of MB at 4K tokens) cost
    #: fresh pages every request; results do not depend on it beyond float rounding
    block_tokens: ClassVar[int] = 256
    #: the same on a GPU, where each block costs kernel launches rather than cache misses: 16
    #: blocks of 256 rows made a 4K correction launch-bound on an H200 (24x its GEMM floor)
    block_tokens_gpu: ClassVar[int] = 2048
    learns_online = True
    none_words = {"rank": "full"}

    def validate(self) -> None:
        check(self.anchors >= 1, "anchors", f"must be a positive integer, got {self.anchors}")
        check(0.0 <= self.tau <= 1.0, "tau", f"must lie in [0, 1], got {self.tau}")
        check(self.rank is None or self.rank >= 1, "rank", f"must be a positive integer, got {self.rank}")
        check(
            self.delta_rank is None or self.delta_rank >= 1,
            "delta_rank",
            f"must be a positive integer or none, got {self.delta_rank}",
        )
        check(self.gate_mode in GATES, "gate_mode", f"must be one of {', '.join(GATES)}, got {self.gate_mode!r}")
        check(
            self.gate_temperature > 0 and math.isfinite(self.gate_temperature),
            "gate_temperature",
            f"must be a positive number, got {self.gate_temperature}",
        )
        check(
            self.temperature > 0 and math.isfinite(self.temperature),
            "temperature",
            f"must be a positive number, got {self.temperature}",
        )
        check(
            0.0 < self.activation_top_p <= 1.0, "activation_top_p", f"must lie in (0, 1], got {self.activation_top_p}"
        )
        check(
            self.anchor_dtype is None or self.anchor_dtype in ANCHOR_DTYPES,
            "anchor_dtype",
            f"must be bfloat16, float16 or float32, got {self.anchor_dtype!r}",
        )
        check(self.svd in FACTORIZATIONS, "svd", f"must be one of {', '.join(FACTORIZATIONS)}, got {self.svd!r}")
        check(0.0 <= self.prune_tol < 0.5, "prune_tol", f"must lie in [0, 0.5), got {self.prune_tol}")

    @classmethod
    def workload_defaults(cls, workload) -> dict:
        return {} if workload.default_tau is None else {"tau": workload.default_tau}

    def resolved(self, device, width: int | None = None) -> dict:
        """The factorization ``svd`` runs on ``device`` for K/V rows of ``width`` (low-rank anchors only:
        full ones have none)."""
        if self.rank is None:
            return {}
        return {"svd": factorization(self.svd, torch.device(device), self.rank, width)}

    def _count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    # ---- reference ---------------------------------------------------------------------------
    def reference_of(self, ctx: SegmentContext) -> SegmentKV | None:
        """Chained: the source agent's cache. Non-chained: the context-free reference, prefilled
        once per first-seen segment (its time lands in the TTFT of the request waiting for it)."""
        if self.chained:
            return ctx.source
        key = (ctx.slot, tuple(ctx.segment.ids))
        ref = self.references.get(key)
        if ref is None:
            ref = ctx.reference()
            self.references[key] = ref
            while len(self.references) > self.max_references:
                self.references.pop(next(iter(self.references)))
        return ref

    # ---- the one override point --------------------------------------------------------------
    def materialize(self, ctx: SegmentContext) -> SegmentKV:
        ref = self.reference_of(ctx)
        if ref is None:
            return ctx.dense()
        inv = ctx.engine.inv_freq
        pool = self.pools.setdefault(ctx.slot, AnchorPool(self.anchors))
        if ctx.forced == "dense":  # a controlled reuse ratio (serve-sweep --rho): this one falls back
            decision = None
            ctx.details["gate"] = GateOutcome.SCHEDULED_DENSE
        else:
            decision = self.gate(
                pool, ctx.consumer, ref.v, ctx.length, ctx.details, force=ctx.forced == "reuse", shards=ctx
            )
        if decision is not None:
            kv = self.correct(ctx, decision, ref)
            if kv is not None:
                self._count("accepted")
                return kv
            self._count("nonfinite_fallback")
            ctx.details["fallback"] = "nonfinite"
        else:
            ctx.details["fallback"] = "dense"
        self._count("dense_fallback")
        exact = ctx.dense()
        instance, source_key = instance_key(ctx.segment.ids, ctx.segment.content_key), (ref.uid,)
        ctx.defer(
            lambda: self.insert(
                pool,
                instance,
                source_key,
                shift_to_rows(ref.k, -ref.start, inv),
                rows_copy(ref.v),
                ctx.consumer,
                exact,
                inv,
            )
        )
        return exact

    @property
    def reuse_from(self) -> str:  # type: ignore[override]
        """Chained: the source (segments with one are eligible); non-chained: the context-free
        reference (every shared segment is eligible, the first agent's included)."""
        return "source" if self.chained else "reference"

    def counters(self) -> dict[str, int]:
        evicted = sum(p.evicted for p in self.pools.values())
        return {**self.stats, "anchors_evicted": evicted} if evicted else dict(self.stats)

    # ---- Eq. 9-11 ------------------------------------------------------------------------------
    def gate(
        self,
        pool: AnchorPool,
        consumer: str,
        ref_v: torch.Tensor,
        S: int,
        details: dict | None = None,
        force: bool = False,
        shards: SegmentContext | None = None,
    ) -> GateDecision | None:
        """Pick compatible anchors and decide reliability by normalized gate entropy.

        ``ref_v``: the reference's values, head-major ``[layers, kv_heads, S, hd]`` (as caches hold
        them) or in the row layout ``[layers, S, D]``.

        Variable lengths (paper A.3; :func:`~kvcmas_bench.ops.gate_outcome.gate_route`): with the
        consumer's stored anchor lengths l1 >= l2 >= ..., the comparison prefix is k = min(S, l2),
        i.e. the second-longest anchor sets it (the longest prefix two anchors cover; equal lengths
        count separately). The gate and the correction both use exactly the anchors at least k long,
        each through its first k rows (rows of a longer anchor beyond k are never read); shorter
        anchors take no part, not even in the rows they cover; rows k..S-1 stay the aligned
        reference. ``full_coverage``: only anchors covering the whole segment count, so k = S (as
        KVCOMM's code gates). With a pool of one the gate is bypassed and k = min(S, l1) (paper C.3).
        ``details`` receives the decision's accounting: outcome, compatible anchors, comparison
        prefix, entropy and the anchors whose activation counts it raised. ``force`` (a scheduled
        reuse, serve-sweep's controlled rho): accept whatever the entropy, with one anchor too.
        ``shards``: the context whose :meth:`~SegmentContext.reduce_heads` sums the distances over the
        KV heads other tensor-parallel ranks hold (None: this process holds them all).
        """
        details = {} if details is None else details
        lengths = self._gate_lengths(pool, consumer, S, details)
        outcome, k = gate_route(lengths, S, self.anchors, force)
        if outcome is not None:
            return self._uncompared(pool, consumer, outcome, k, details)
        cands = pool.compatible(consumer, k)
        dist_v = self._gate_sqdist(cands, consumer, ref_v, k, shards)
        sq = dist_v.sum(1)
        h, g = gate_entropy(gate_scores(sq, self.gate_mode, self.gate_temperature), self.temperature)
        self.entropies.append((h, S))
        details.update(compare_tokens=k, entropy=h, anchors_compared=len(cands), distances=rounded_distances(sq))
        outcome = entropy_verdict(h, self.tau, force)
        if not outcome.reuses:
            details["gate"] = outcome
            return None
        details.update(gate=outcome, anchors_used=self.activate(cands, g))
        return GateDecision(cands, k, g, h, dist_v)

    def _gate_lengths(self, pool: AnchorPool, consumer: str, S: int, details: dict) -> list[int]:
        """The stored lengths of the consumer's anchors the gate may use, longest first (``full_coverage``:
        only those covering the ``S`` tokens); their counts go to ``details``."""
        lengths = pool.lengths(consumer)
        details["anchors_available"] = len(lengths)
        if self.full_coverage:
            lengths = [n for n in lengths if n >= S]
            details["anchors_covering"] = len(lengths)
        return lengths

    @staticmethod
    def _uncompared(
        pool: AnchorPool, consumer: str, outcome: GateOutcome, k: int, details: dict
    ) -> GateDecision | None:
        """The decision of an outcome taken without comparing: the anchors covering ``k`` with equal
        weights (bypassed, scheduled), or None (no or too few anchors: dense fallback)."""
        if not outcome.reuses:
            details["gate"] = outcome
            return None
        cands = pool.compatible(consumer, k)
        details.update(gate=outcome, compare_tokens=k, anchors_used=len(cands))
        return GateDecision(cands, k, torch.ones(len(cands)), None)

    def _gate_sqdist(
        self, cands: list[Anchor], consumer: str, ref_v: torch.Tensor, k: int, shards: SegmentContext | None
    ) -> torch.Tensor:
        """``[n, k]`` squared distance of the reference's values to each candidate's base, block by block,
        summed over every tensor-parallel rank's heads (``shards``)."""
        bases = FactorStack.of(cands, consumer, "base_v")
        dist_v = torch.cat(
            [self.token_sqdist(bases, _block(ref_v, s, n), s) for s, n in self.blocks(k, ref_v.device)], dim=1
        )
        return dist_v if shards is None else shards.reduce_heads(dist_v)

    def activate(self, cands: list[Anchor], g: torch.Tensor) -> int:
        """Raise the activation counts (the LFU eviction's) of the smallest top set of anchors whose
        gate weights reach ``activation_top_p`` (KVComm's rule); returns its size."""
        order = torch.argsort(g, descending=True)
        n_top = int((torch.cumsum(g[order], 0) < self.activation_top_p).sum()) + 1
        for i in order[:n_top].tolist():
            cands[i].count += 1
        return n_top

    def blocks(self, k: int, device: torch.device | None = None):
        """``(start, n)`` of the consecutive blocks of at most :attr:`block_tokens` rows covering ``k``
        (:attr:`block_tokens_gpu` on a CUDA ``device``)."""
        on_gpu = device is not None and device.type == "cuda"
        return block_ranges(k, self.block_tokens_gpu if on_gpu else self.block_tokens)

    @staticmethod
    def token_sqdist(stack: FactorStack, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``[n, t]`` squared distance of every token of ``x`` (rows ``start .. start + t`` of the
        segment, head-major or row layout, see :func:`_block`) to each anchor's base in ``stack``,
        summed over layers and this rank's heads: from the factors (one GEMM with the stacked B, ``x``
        copied once into its operand) for low-rank anchors, by reconstruction for full-dimensional ones."""
        t = _tokens(x)
        if stack.lowrank:
            y, x_sq = operand_rows(x, stack.b_t.dtype)
            return lowrank_token_sqdist(
                y, x_sq, stack.a_rows(start, t), stack.sq_rows(start, t), stack.b_t, stack.ranks
            )
        x = _rows(x)
        return torch.stack([(x - r.float()).square().sum(dim=(0, 2)) for r in stack.rows(start, t)])

    def token_distance(
        self,
        stack: FactorStack,
        x: torch.Tensor,
        start: int = 0,
        sqdist: torch.Tensor | None = None,
        shards: SegmentContext | None = None,
    ) -> torch.Tensor:
        """Token-wise distance to each anchor base (``[n, t]``) for the interpolation weights.

        Full-dimensional anchors (KVComm): mean absolute distance, as KVComm computes it. Low-rank
        anchors (KVCMAS): root-mean-square distance from the factors, which reuses the gate's GEMM
        and never reconstructs an anchor (the L1 distance would need every ``A @ B``). Under tensor
        parallelism (``shards``) both are taken over every rank's heads: sums reduced, then divided
        by the element count of all of them. ``sqdist`` is already reduced.
        """
        n_shards = 1 if shards is None else shards.head_shards
        elements = x.numel() // _tokens(x) * n_shards
        if stack.lowrank:
            if sqdist is None:
                sqdist = self.token_sqdist(stack, x, start)
                if shards is not None:
                    sqdist = shards.reduce_heads(sqdist)
            return (sqdist / elements).sqrt()
        x = _rows(x)
        # one anchor's difference at a time: V of them at once is V x [layers, block, D] float32
        rows = stack.rows(start, x.shape[1])
        if n_shards == 1:
            return torch.stack([(x - r.float()).abs().mean(dim=(0, 2)) for r in rows])
        return shards.reduce_heads(torch.stack([(x - r.float()).abs().sum(dim=(0, 2)) for r in rows])) / elements

    # ---- Eq. 8 ---------------------------------------------------------------------------------
    def correct(self, ctx: SegmentContext, dec: GateDecision, ref: SegmentKV) -> SegmentKV | None:
        """``align(C_ref) + sum_v w_v A_v B_v`` on the covered prefix, aligned rows beyond it.

        Keys are compared and corrected in one frame of positions: low-rank key factors are moved to
        the reference's positions (their ``B`` rotated, :meth:`FactorStack.rotated`), so the
        reference's keys are read as they are and rotated once, from the reference's positions
        straight to the segment's, together with their correction; full-dimensional ones stay
        canonical (position 0) and the reference's keys are made canonical block by block.

        Block by block of :attr:`block_tokens` rows, K then V: the block's token weights, its weighted
        deltas, and its corrected rows written straight into the context's output rows in the engine's
        layout (:func:`add_shift_into`): in-process the request cache's own rows, so no buffer of the
        segment's size is made or copied before the first token. ``ref`` stays as it is: a NaN/inf
        correction returns None (the dense fallback then overwrites the rows it wrote) and it serves
        the fallback's anchor.
        """
        plan = self._correction_plan(ctx, dec, ref)
        tally = CorrectionTally.zeros(ref.v.device)
        for start, n in self.blocks(dec.k, ref.v.device):
            for p in "kv":
                tally = self._correct_block(plan, p, start, n, tally)
        bad, kept_k, kept_v, dropped = tally.read(ctx.reduce_heads if ctx.head_shards > 1 else None)
        if bad:  # the dense fallback overwrites the rows written
            return None
        self._align_tail(plan)
        ctx.details.update(applied_figures(kept_k, kept_v, dropped, dec.k))
        kv = SegmentKV(
            k=plan.out["k"], v=plan.out["v"], start=ctx.start, ids=tuple(ctx.segment.ids), status="corrected"
        )
        if self.exact_layer0:
            kv = ctx.exact_layer0(kv, ref)
        return kv

    @staticmethod
    def _correction_plan(ctx: SegmentContext, dec: GateDecision, ref: SegmentKV) -> _CorrectionPlan:
        """The factor stacks of the decision's anchors (keys' ``B`` rotated to the reference's positions
        when every key factor is low-rank) and the context's output rows."""
        out = dict(zip("kv", ctx.output_rows()))
        stacks = {
            p: (
                FactorStack.of(dec.anchors, ctx.consumer, f"base_{p}"),
                FactorStack.of(dec.anchors, ctx.consumer, f"delta_{p}"),
            )
            for p in "kv"
        }
        frame = ref.start if all(f.lowrank for f in stacks["k"]) else 0
        stacks["k"] = tuple(f.rotated(frame, ctx.engine.inv_freq, ref.k.shape[1]) for f in stacks["k"])
        return _CorrectionPlan(ctx, dec, ref, stacks, frame, out)

    def _correct_block(
        self, plan: _CorrectionPlan, p: str, start: int, n: int, tally: CorrectionTally
    ) -> CorrectionTally:
        """Rows ``start .. start + n`` of part ``p``: token weights, the weighted deltas (the stacked GEMM
        or the pruned terms, :func:`select_terms`), the corrected rows written into the output."""
        x = plan.reference_block(p, start, n)
        bases, deltas = plan.stacks[p]
        dist = self.token_distance(bases, x, start, plan.gate_sqdist(p, start, n), plan.ctx)
        w = token_weights(dist, self.temperature)
        keep, mass, stacked = select_terms(w, self.prune_tol)
        if stacked:
            corr = self.weighted_delta(deltas, w, start)
        else:
            corr = sparse_apply(w, keep, deltas.a_rows(start, n), deltas.b_list())
        tally = tally.add(p, corr, keep, mass)
        add_shift_into(plan.out[p][:, :, start : start + n], x, plan.shift(p), plan.inv_freq, corr)
        return tally

    @staticmethod
    def _align_tail(plan: _CorrectionPlan) -> None:
        """Rows beyond the covered prefix: the aligned reference."""
        ctx, ref, k, out = plan.ctx, plan.ref, plan.dec.k, plan.out
        if k < ref.v.shape[2]:
            add_shift_into(out["k"][:, :, k:], ref.k[:, :, k:], ctx.start - ref.start, plan.inv_freq)
            add_shift_into(out["v"][:, :, k:], ref.v[:, :, k:], 0, plan.inv_freq)

    @staticmethod
    def weighted_delta(stack: FactorStack, w: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``sum_v w[v, t] Delta_v[l, start + t]``, ``[layers, t, D]``: one GEMM over the stacked
        factors (in their dtype) for low-rank anchors, a weighted sum of the rows (float32) otherwise."""
        t = w.shape[1]
        if stack.lowrank:
            return lowrank_apply(w, stack.a_rows(start, t), stack.b_all, stack.ranks)
        return weighted_rows(w, stack.rows(start, t))

    # ---- Eq. 12 --------------------------------------------------------------------------------
    def insert(
        self,
        pool: AnchorPool,
        instance: str,
        source_key: tuple,
        ref_k: torch.Tensor,
        ref_v: torch.Tensor,
        consumer: str,
        exact: SegmentKV,
        inv_freq: torch.Tensor,
    ) -> None:
        """The consumer's entry from a dense fallback (Eq. 12): base = C_ref, Delta = C_j - align(C_ref)
        (canonical), in the newest anchor of this content if it has no entry for the consumer yet,
        else in a new anchor (:meth:`AnchorPool.joinable`): a repeated fallback adds an anchor."""
        ex_k = shift_to_rows(exact.k, -exact.start, inv_freq)
        ex_v = rows_copy(exact.v)
        dtype = getattr(torch, self.anchor_dtype) if self.anchor_dtype else exact.k.dtype
        ex_k -= ref_k
        ex_v -= ref_v
        before = pool.inserted
        pool.add(
            instance,
            source_key,
            ref_k,
            ref_v,
            consumer,
            ex_k,
            ex_v,
            self.rank,
            dtype,
            self.svd,
            delta_rank=self.delta_rank,
        )
        self._count("entries_inserted")
        if pool.inserted > before:
            self._count("anchors_inserted")

    def state_layout(self) -> dict:
        """Anchors, entries and bytes per slot pool (per anchor and per entry), and their totals."""
        slots = {slot: pool.layout() for slot, pool in self.pools.items()}
        total = total_layout(list(slots.values()))
        total["reference_bytes"] = sum(r.nbytes for r in self.references.values())
        return {"total": total, "slots": slots}

    def state_bytes(self) -> int:
        n = sum(p.nbytes for p in self.pools.values())
        return n + sum(r.nbytes for r in self.references.values())


def _block(x: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows ``start .. start + n`` of a segment's cache part, in its own layout: head-major
    ``[layers, kv_heads, S, hd]`` (4-D, as caches hold it) or row layout ``[layers, S, D]`` (3-D)."""
    return x[:, :, start : start + n] if x.dim() == 4 else x[:, start : start + n]


def _tokens(x: torch.Tensor) -> int:
    return x.shape[2] if x.dim() == 4 else x.shape[1]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the row layout, float32 (a copy when it is head-major)."""
    return rows_copy(x) if x.dim() == 4 else x.float()
