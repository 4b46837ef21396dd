"""Where KVCMAS's anchor construction after a dense fallback spends its time, on a model's K/V shape.

No model is loaded: the K/V of one ``--tokens`` segment are synthetic (a decaying spectrum with one
dominant direction per matrix, the exact cache in bfloat16 as a bf16 model's), so the figures are
timings only. Prints min / median / max of ``--repeats`` runs after one untimed run (the format of
every script here):

  1. one pool insertion (``KVCMASMethod.insert``: the exact keys rotated to canonical positions, the
     deltas, the rank-32 factors of the K/V deltas and bases) with ``svd=subspace`` and anchors in the
     model's dtype (bfloat16) and in float32, and with ``svd=gram`` (the exact factorization);
  2. the four stacks in one subspace iteration vs one stack alone, float32 and bfloat16 Gram matrices,
     and the Gram GEMM itself in both;
  3. one insertion under the torch profiler: the operators by device time and by host time, and the
     number of operator calls (on a GPU the insertion is host-bound when the host time exceeds the
     device time).

Defaults: the Llama-3.1-8B shape (32 layers, 8 KV heads of 128), 4096 tokens, on CUDA. The CPU works
with smaller shapes (``--device cpu --layers 4 --tokens 1024 --heads 2``), for a smoke test.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import Summary, fmt, print_header, spread_verdict, timed

from kvcmas_bench.engine import SegmentKV
from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import AnchorPool
from kvcmas_bench.ops import lowrank as lr


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--hd", type=int, default=128, help="head dimension")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print_header()
    dev = torch.device(args.device)
    L, S, H, hd = args.layers, args.tokens, args.heads, args.hd
    D = H * hd

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def now() -> float:
        sync()
        return time.perf_counter()

    def timeit(fn) -> Summary:
        return timed(fn, args.repeats, warmup=1, clock=now)

    def spectral(seed: int, dominant: float, decay: float) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        s = torch.arange(1, D + 1, dtype=torch.float32) ** -decay
        s[0] *= dominant
        u = torch.randn(L, S, D, generator=g) / S**0.5
        v = torch.randn(L, D, D, generator=g) / D**0.5
        return torch.bmm(u.to(dev) * s.to(dev), v.to(dev))

    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))).to(dev)
    ref_k, ref_v = spectral(1, 30.0, 0.8), spectral(2, 5.0, 0.7)
    exact = SegmentKV(
        k=lr.from_rows(ref_k + 0.1 * spectral(3, 10.0, 1.0), H).to(torch.bfloat16).contiguous(),
        v=lr.from_rows(ref_v + 0.1 * spectral(4, 100.0, 1.0), H).to(torch.bfloat16).contiguous(),
        start=37,
        ids=tuple(range(S)),
    )
    dk = lr.shift_to_rows(exact.k, -exact.start, inv_freq) - ref_k
    dv = lr.rows_copy(exact.v) - ref_v
    print(f"K/V shape: layers {L}, {S} tokens, D = {H} x {hd} = {D}; device {dev}, torch {torch.__version__}")

    def insert(svd: str, anchor_dtype: str | None = None):
        m = get_method("kvcmas", svd=svd, anchor_dtype=anchor_dtype)
        return lambda: m.insert(AnchorPool(10), "x", ("x",), ref_k, ref_v, "B", exact, inv_freq)

    print("1. one pool insertion")
    for svd, adt in (("subspace", None), ("subspace", "float32"), ("gram", None)):
        name = adt or "the model's (bfloat16)"
        print(f"  svd={svd}, anchors {name}: {fmt(timeit(insert(svd, adt)), digits=4)}")
    print("2. factorizations (ms)")
    four = [dk, dv, ref_k, ref_v]
    for low in (None, torch.bfloat16):
        name = "bfloat16" if low else "float32"
        t4 = timeit(lambda low=low: lr.subspace_factors(four, 32, gram_dtype=low))
        t1 = timeit(lambda low=low: lr.truncated_svd_subspace(dk, 32, gram_dtype=low))
        g = timeit(lambda low=low: lr.gram_matrices(dk, low))
        print(f"  {name} Gram: four stacks in one iteration {fmt(t4.map(lambda x: 1e3 * x), 'ms', 1)}")
        print(f"  {name} Gram: one stack alone {fmt(t1.map(lambda x: 1e3 * x), 'ms', 1)}")
        print(f"  {name} Gram: the Gram GEMM of one stack {fmt(g.map(lambda x: 1e3 * x), 'ms', 2)}")
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    run = insert("subspace")
    run()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        sync()
    ev = prof.key_averages()
    print("3. one insertion (svd=subspace, bfloat16 anchors) under the profiler")
    if cuda:
        print(ev.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=40))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40))
    print(f"  operator calls: {sum(e.count for e in ev)}")
    print(f"\n{spread_verdict()}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
