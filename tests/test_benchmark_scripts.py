"""Pieces of the benchmark scripts that decide what they print."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from delta_correction import time_by_kind  # noqa: E402

CPU = SimpleNamespace(device=torch.device("cpu"), now=time.perf_counter)


def test_time_by_kind_puts_a_gemm_and_an_elementwise_pass_in_their_kinds():
    a, b = torch.randn(8, 256, 256), torch.randn(8, 256, 256)

    wall, kinds = time_by_kind(lambda: torch.bmm(a, b), CPU)
    assert kinds["GEMMs"] > 0.0
    assert kinds["element-wise arithmetic"] == 0.0
    assert kinds["copies and conversions"] == 0.0
    assert kinds["GEMMs"] <= wall

    wall, kinds = time_by_kind(lambda: a.mul(b).sum(dim=1), CPU)
    assert kinds["GEMMs"] == 0.0
    assert kinds["element-wise arithmetic"] > 0.0

    wall, kinds = time_by_kind(lambda: a.to(torch.bfloat16), CPU)
    assert kinds["copies and conversions"] > 0.0
    assert kinds["GEMMs"] == 0.0 and kinds["element-wise arithmetic"] == 0.0


def test_time_by_kind_counts_an_unlisted_operator_as_other():
    a = torch.randn(512, 512)
    _, kinds = time_by_kind(lambda: torch.linalg.qr(a), CPU)
    assert kinds["other operators"] > 0.0
