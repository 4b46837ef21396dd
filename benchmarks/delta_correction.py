"""Benchmark: anchor-state memory of KVCMAS vs KVComm and the cost of a KVCMAS correction.

Prints, side by side in one run on the default model (SmolLM2-135M unless --model):
  * bytes of one anchor (base + one consumer's delta, K and V, all layers), measured from the
    tensors the pools actually hold, and of a full pool (KVCMAS V=10 rank 32, KVComm V=20
    full-dimensional) at 1K/2K/4K shared tokens. Goal: KVCMAS <= 1/8 of KVComm at 4K.
  * the time to correct a 4K-token segment (gate + weights + apply over all layers, V=10 anchors,
    accepted) as a fraction of its dense prefill over the same prefix. Goal: <= 10%.

The pools are filled from one real observation (agent A's dense cache of the segment as base,
agent B's exact delta) replicated with small perturbations: sizes and costs depend only on
shapes, and building ten real observations at 4K would cost minutes of prefill.

    python benchmarks/delta_correction.py [--tokens 1024,2048,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import prefix, shared_ids

from kvcmas_bench.engine import Engine, Request, Segment, SegmentContext
from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import Anchor, AnchorPool, Factor
from kvcmas_bench.modeling import load_model
from kvcmas_bench.ops.lowrank import canonical_keys, to_rows


def dense_segment(engine: Engine, pre: list[int], seg: list[int]):
    cache = engine.new_cache(len(pre) + len(seg) + 1)
    engine.prefill(cache, pre, 0)
    t0 = engine.now()
    kv, _ = engine.prefill(cache, seg, len(pre))
    return kv, engine.now() - t0, cache


def fill_pool(method, slot: str, consumer: str, base_k, base_v, dk, dv, n: int, rank: int | None, dtype=None):
    """``n`` anchors: the real observation plus perturbed copies (distinct gate distances)."""
    pool = AnchorPool(method.anchors)
    first = pool.add(("real",), base_k, base_v, consumer, dk, dv, rank, dtype)
    for i in range(1, n):
        noise = 1.0 + 0.01 * i
        pool.anchors.append(
            Anchor(
                Factor(first.base_k.a * noise, first.base_k.b),
                Factor(first.base_v.a * noise, first.base_v.b),
                ("copy", i),
                i,
                {consumer: first.deltas[consumer]},
            )
        )
    method.pools[slot] = pool
    return pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model, args.dtype, args.device)
    engine = Engine(lm.model, lm.tokenizer)
    lengths = [int(x) for x in args.tokens.split(",")]
    seg_all = shared_ids(lm.tokenizer, max(lengths))
    pre_a, pre_b = prefix(lm.tokenizer, "planner"), prefix(lm.tokenizer, "critic")
    inv = engine.inv_freq
    print(
        f"model {lm.name}: layers {engine.n_layers}, D = kv_heads*head_dim = {engine.n_kv * engine.head_dim}, "
        f"device {engine.device}, dtype {engine.dtype}"
    )
    print(
        f"{'tokens':>7} {'KVCMAS anchor':>14} {'KVComm anchor':>14} {'KVCMAS pool V=10':>17} "
        f"{'KVComm pool V=20':>17} {'ratio':>7}"
    )
    last = None
    for n in lengths:
        seg = seg_all[:n]
        kv_a, _, _ = dense_segment(engine, pre_a, seg)
        kv_b, t_dense, cache_b = dense_segment(engine, pre_b, seg)
        base_k = to_rows(canonical_keys(kv_a.k, kv_a.start, inv))
        base_v = to_rows(kv_a.v)
        dk = to_rows(canonical_keys(kv_b.k, kv_b.start, inv)) - base_k
        dv = to_rows(kv_b.v) - base_v
        low = AnchorPool(10).add(("x",), base_k, base_v, "B", dk, dv, 32).nbytes
        full = AnchorPool(20).add(("x",), base_k, base_v, "B", dk, dv, None).nbytes
        print(
            f"{n:>7} {low / 2**20:>11.1f} MiB {full / 2**20:>11.1f} MiB {10 * low / 2**20:>14.1f} MiB "
            f"{20 * full / 2**20:>14.1f} MiB {20 * full / (10 * low):>6.1f}x"
        )
        last = (n, seg, kv_a, base_k, base_v, dk, dv, t_dense, cache_b)
    n, seg, kv_a, base_k, base_v, dk, dv, _, cache_b = last
    req = Request("B", [Segment("PF", pre_b), Segment("PH", seg, slot="q", source="A"), Segment("PF", [1])], 1)
    dense_t = []
    for _ in range(args.repeats):
        _, t, _ = dense_segment(engine, pre_b, seg)
        dense_t.append(t)
    d = statistics.median(dense_t)
    print(
        f"\ncorrection of a {n}-token segment (V=10, r=32, all {engine.n_layers} layers, accepted) vs its dense "
        f"prefill over the same prefix: median {d:.3f} s"
    )
    for dtype in (None, "bfloat16"):
        m = get_method("kvcmas", tau=1.0, anchor_dtype=dtype)
        pool = fill_pool(m, "q", "B", base_k, base_v, dk, dv, 10, 32, getattr(torch, dtype) if dtype else None)
        corr_t = []
        for _ in range(args.repeats):
            ctx = SegmentContext(engine, cache_b, req, req.segments[1], len(pre_b), kv_a)
            t0 = engine.now()
            out = m.materialize(ctx)
            corr_t.append(engine.now() - t0)
            assert out.status == "corrected", out.status
        c = statistics.median(corr_t)
        print(
            f"  anchors in {dtype or str(engine.dtype).replace('torch.', '')}: {c:.3f} s = {100 * c / d:.1f}% "
            f"of dense (goal <= 10%); pool of 10 anchors {pool.nbytes / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
