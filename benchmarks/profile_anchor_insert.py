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
from dataclasses import dataclass

import torch
from common import Summary, fmt, print_header, spread_verdict, timed

from kvcmas_bench.methods import get_method
from kvcmas_bench.methods.anchors import AnchorPool
from kvcmas_bench.ops import lowrank as lr
from kvcmas_bench.segments import SegmentKV


@dataclass
class Shape:
    """The synthetic segment's K/V shape, the device and the repeats of every timing."""

    device: torch.device
    layers: int
    tokens: int
    heads: int
    hd: int
    repeats: int

    @property
    def D(self) -> int:
        return self.heads * self.hd

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def timeit(self, fn) -> Summary:
        return timed(fn, self.repeats, warmup=1, clock=self.now)

    def spectral(self, seed: int, dominant: float, decay: float) -> torch.Tensor:
        """``[layers, tokens, D]`` rows with a decaying spectrum and one dominant direction per matrix."""
        L, S, D = self.layers, self.tokens, self.D
        g = torch.Generator().manual_seed(seed)
        s = torch.arange(1, D + 1, dtype=torch.float32) ** -decay
        s[0] *= dominant
        u = torch.randn(L, S, D, generator=g) / S**0.5
        v = torch.randn(L, D, D, generator=g) / D**0.5
        return torch.bmm(u.to(self.device) * s.to(self.device), v.to(self.device))


@dataclass
class Segment:
    """One synthetic segment: the reference rows, the exact cache (bfloat16) and their deltas."""

    inv_freq: torch.Tensor
    ref_k: torch.Tensor
    ref_v: torch.Tensor
    exact: SegmentKV
    dk: torch.Tensor
    dv: torch.Tensor

    @classmethod
    def of(cls, sh: Shape) -> Segment:
        hd, H = sh.hd, sh.heads
        inv_freq = (1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))).to(sh.device)
        ref_k, ref_v = sh.spectral(1, 30.0, 0.8), sh.spectral(2, 5.0, 0.7)
        exact = SegmentKV(
            k=lr.from_rows(ref_k + 0.1 * sh.spectral(3, 10.0, 1.0), H).to(torch.bfloat16).contiguous(),
            v=lr.from_rows(ref_v + 0.1 * sh.spectral(4, 100.0, 1.0), H).to(torch.bfloat16).contiguous(),
            start=37,
            ids=tuple(range(sh.tokens)),
        )
        dk = lr.shift_to_rows(exact.k, -exact.start, inv_freq) - ref_k
        dv = lr.rows_copy(exact.v) - ref_v
        return cls(inv_freq, ref_k, ref_v, exact, dk, dv)

    def insert(self, svd: str, anchor_dtype: str | None = None):
        """One pool insertion of the segment as KVCMAS makes it after a dense fallback, as a callable."""
        m = get_method("kvcmas", svd=svd, anchor_dtype=anchor_dtype)
        return lambda: m.insert(AnchorPool(10), "x", ("x",), self.ref_k, self.ref_v, "B", self.exact, self.inv_freq)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--hd", type=int, default=128, help="head dimension")
    ap.add_argument("--repeats", type=int, default=5)
    return ap.parse_args(argv)


def insertions(sh: Shape, seg: Segment) -> None:
    """Section 1: one pool insertion per factorization and anchor dtype."""
    print("1. one pool insertion")
    for svd, adt in (("subspace", None), ("subspace", "float32"), ("gram", None)):
        name = adt or "the model's (bfloat16)"
        print(f"  svd={svd}, anchors {name}: {fmt(sh.timeit(seg.insert(svd, adt)), digits=4)}")


def factorizations(sh: Shape, seg: Segment) -> None:
    """Section 2: the four stacks in one subspace iteration vs one alone, and the Gram GEMM."""
    print("2. factorizations (ms)")
    four = [seg.dk, seg.dv, seg.ref_k, seg.ref_v]
    for low in (None, torch.bfloat16):
        name = "bfloat16" if low else "float32"
        t4 = sh.timeit(lambda low=low: lr.subspace_factors(four, 32, gram_dtype=low))
        t1 = sh.timeit(lambda low=low: lr.truncated_svd_subspace(seg.dk, 32, gram_dtype=low))
        g = sh.timeit(lambda low=low: lr.gram_matrices(seg.dk, low))
        print(f"  {name} Gram: four stacks in one iteration {fmt(t4.map(lambda x: 1e3 * x), 'ms', 1)}")
        print(f"  {name} Gram: one stack alone {fmt(t1.map(lambda x: 1e3 * x), 'ms', 1)}")
        print(f"  {name} Gram: the Gram GEMM of one stack {fmt(g.map(lambda x: 1e3 * x), 'ms', 2)}")


def profiled(sh: Shape, seg: Segment) -> None:
    """Section 3: one insertion under the torch profiler, operators by device and host time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = sh.device.type == "cuda"
    run = seg.insert("subspace")
    run()
    sh.sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        sh.sync()
    ev = prof.key_averages()
    print("3. one insertion (svd=subspace, bfloat16 anchors) under the profiler")
    if cuda:
        print(ev.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=40))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40))
    print(f"  operator calls: {sum(e.count for e in ev)}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_header(argv)
    sh = Shape(torch.device(args.device), args.layers, args.tokens, args.heads, args.hd, args.repeats)
    seg = Segment.of(sh)
    print(
        f"K/V shape: layers {sh.layers}, {sh.tokens} tokens, D = {sh.heads} x {sh.hd} = {sh.D}; "
        f"device {sh.device}, torch {torch.__version__}"
    )
    insertions(sh, seg)
    factorizations(sh, seg)
    profiled(sh, seg)
    print(f"\n{spread_verdict()}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
