"""Pieces of the benchmark scripts that decide what they print."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import Summary  # noqa: E402
from delta_correction import Floor, Gemm, correction_gemms, gemm_calls, time_by_kind, timed_with_floor  # noqa: E402

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


def test_the_floor_is_timed_between_the_corrections_runs():
    """A fake clock that each call advances by a scripted amount. 3 runs with at least 5 GEMM
    timings per shape: after one untimed call of each, every run is followed by ceil(5/3) = 2 timings
    of each shape, so 6 per shape, in the order run, d, d, a, a, run, ... The machine is "slow" during
    the second run (every call 10x): the floor is the best timing of each shape (1 s + 2 s, made by
    hand), while the floor per timing run shows the slow phase."""
    now, log, slow = [0.0], [], [False]

    def tick(name, cost):
        def call():
            log.append(name)
            now[0] += cost * (10 if slow[0] else 1)
            return name

        return call

    runs = iter([False, False, True, False])  # the untimed run, then runs 1-3: run 2 is slow

    def fn():
        slow[0] = next(runs)
        return tick("run", 0.5)()

    d = Gemm("dist", "distance", 1, 4, 2, 3)
    a = Gemm("apply", "apply", 1, 4, 2, 3)
    calls = {d.shape: tick("d", 1.0), a.shape: tick("a", 2.0)}
    c, floor = timed_with_floor(fn, [d, a], calls, repeats=3, gemm_repeats=5, clock=lambda: now[0])
    assert log[:3] == ["run", "d", "a"]
    assert log[3:] == ["run", "d", "d", "a", "a"] * 3
    assert c.samples == (0.5, 5.0, 0.5)
    assert floor.n == 6
    assert floor.times[d.shape].samples == (1.0, 1.0, 10.0, 10.0, 1.0, 1.0)
    assert floor.seconds() == 3.0
    assert floor.halves() == (3.0, 3.0)
    assert floor.per_run().samples == (3.0, 3.0, 30.0, 30.0, 3.0, 3.0)


def test_gemm_calls_use_the_corrections_operand_layouts():
    """One call per distinct shape; a distance GEMM multiplies ``[L, k, D]`` by a contiguous ``[L, D, R]``
    (``B_all^T`` as the correction stores it), an apply GEMM ``[L, k, R]`` by ``[L, R, D]``."""
    g = [Gemm("x", "distance", 2, 5, 4, 3), Gemm("y", "distance", 2, 5, 4, 3), Gemm("z", "apply", 2, 5, 4, 3)]
    calls = gemm_calls(CPU, g, torch.float32)
    assert len(calls) == 2
    assert calls[g[0].shape]().shape == (2, 5, 3)
    assert calls[g[2].shape]().shape == (2, 5, 4)
    x, y = calls[g[0].shape].__defaults__
    assert y.is_contiguous() and y.shape == (2, 4, 3)


def test_the_floor_counts_each_block_shape_as_often_as_the_correction_runs_it():
    """Blocks of 256, 256 and 100 rows, two anchors of ranks 3 and 5 (R = 8): per part one GEMM shape
    of 256 rows run twice and one of 100 rows run once. FLOPs by hand: 2 * L * k * D * R with L = 2,
    D = 4: (2 * 2 * 256 * 4 * 8) * 2 + 2 * 2 * 100 * 4 * 8 = 65536 + 12800 = 78336 per part, four
    parts. With 256-row GEMMs best at 1 s and 100-row ones at 0.5 s (distance and apply alike), the
    floor is 4 * (2 * 1 + 0.5) = 10 s."""
    ranks = {"x": 3, "y": 5}
    anchors = [SimpleNamespace(factor=lambda part, consumer, r=r: SimpleNamespace(rank=r)) for r in ranks.values()]
    pool = SimpleNamespace(compatible=lambda consumer, k: anchors if k == 612 else [])
    gemms = correction_gemms(pool, "B", [256, 256, 100], 2, 4)
    assert [(g.kind, g.k, g.count, g.R) for g in gemms] == [
        ("distance", 256, 2, 8),
        ("distance", 100, 1, 8),
        ("distance", 256, 2, 8),
        ("distance", 100, 1, 8),
        ("apply", 256, 2, 8),
        ("apply", 100, 1, 8),
        ("apply", 256, 2, 8),
        ("apply", 100, 1, 8),
    ]
    assert sum(g.flops for g in gemms) == 4 * 78336
    times = {g.shape: Summary((3.0, 1.0, 2.0) if g.k == 256 else (0.5, 0.7, 0.9)) for g in gemms}
    floor = Floor(gemms, times)
    assert floor.seconds() == 10.0
    assert floor.per_run().samples == pytest.approx((26.0, 10.8, 19.6))
    assert floor.throughput(("apply", 2, 100, 4, 8)) == 12800 / 0.5


def test_random_model_keeps_the_architecture_and_says_its_weights_are_random(tiny_model_dir, tmp_path, monkeypatch):
    import json

    import random_model
    from transformers import AutoConfig

    from kvcmas_bench.modeling import load_model

    out = tmp_path / "rand"
    argv = [
        "random_model.py",
        str(out),
        "--config",
        tiny_model_dir,
        "--tokenizer",
        tiny_model_dir,
        "--dtype",
        "float32",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    random_model.main()
    want, got = AutoConfig.from_pretrained(tiny_model_dir), AutoConfig.from_pretrained(out)
    for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert getattr(got, key) == getattr(want, key), key
    assert json.loads((out / "RANDOM_WEIGHTS.json").read_text())["random_weights"] is True
    lm = load_model(str(out))
    assert lm.name.endswith("(random weights)") and "timing and memory only" in lm.source
    real = load_model(tiny_model_dir)
    w_rand, w_real = lm.model.model.layers[0].mlp.up_proj.weight, real.model.model.layers[0].mlp.up_proj.weight
    assert w_rand.shape == w_real.shape and not torch.equal(w_rand, w_real)
    assert "random" not in real.name
    from kvcmas_bench.serving.vllm.inprocess import _resolve_model

    assert _resolve_model(str(out)) == (str(out), f"{out} (random weights)")  # the vLLM path's label too
    assert _resolve_model(tiny_model_dir) == (tiny_model_dir, tiny_model_dir)


def test_random_model_llama_8b_preset_is_the_published_shape():
    from random_model import LLAMA_31_8B
    from transformers import AutoConfig

    from kvcmas_bench.modeling import check_supported

    cfg = AutoConfig.for_model(**LLAMA_31_8B)
    check_supported(cfg)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        cfg.vocab_size = 128256
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert abs(n - 8.03e9) < 0.01e9  # Llama-3.1-8B's published parameter count, by hand


def test_profile_anchor_insert_runs_on_a_small_shape(monkeypatch, capsys):
    """The anchor-insertion profile on the CPU at a small shape (D = 128 > r + 16, so the subspace
    iteration runs): every section prints, with the operator count of the profiled insertion."""
    import profile_anchor_insert

    argv = ["profile_anchor_insert.py", "--device", "cpu", "--layers", "2", "--tokens", "256", "--heads", "2"]
    argv += ["--hd", "64", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    profile_anchor_insert.main()
    out = capsys.readouterr().out
    assert out.startswith("# command: ") and "D = 2 x 64 = 128" in out
    for line in ("svd=subspace, anchors the model's (bfloat16)", "svd=gram", "bfloat16 Gram: four stacks"):
        assert line in out
    assert int(out.rsplit("operator calls: ", 1)[1].split()[0]) > 100


def test_serve_sweep_qps_grid_ends_on_the_first_saturating_point():
    """QPS = utilization / NonShared's trajectory service time (2 s here), sorted, up to the first
    utilization >= 1 (nudged up so that it counts as saturated); 1 is appended when none is listed."""
    from serve_sweep import qps_grid

    assert qps_grid("0.5,0.25", 2.0) == [0.125, 0.25, 0.5 * (1 + 1e-9)]
    assert qps_grid("1.5,0.25,1.0,0.5", 2.0) == [0.125, 0.25, 0.5 * (1 + 1e-9)]  # 1.5 is past the end
    assert qps_grid("2", 2.0) == [1.0 * (1 + 1e-9)]


def test_serve_sweep_speedups_are_other_over_kvcmas_at_the_chosen_qps():
    from serve_sweep import kvcmas_speedups

    row = lambda p50, p90, util=None: {"ttft_p50_s": p50, "ttft_p90_s": p90, "utilization": util}  # noqa: E731
    by = {("nonshared", 4.0): row(0.8, 3.0, 0.9), ("kvcmas", 4.0): row(0.2, 1.0), ("fullshared", 4.0): row(0.1, 2.0)}
    said = []
    fig = kvcmas_speedups(SimpleNamespace(print=said.append), ["nonshared", "kvcmas", "fullshared"], by, 4.0)
    assert fig == {"utilization": 0.9, "speedup": {"nonshared": (4.0, 3.0), "fullshared": (0.5, 2.0)}}
    assert said[0].endswith("at QPS 4, the highest NonShared sustains (utilization 0.90):")
    assert said[1:] == [
        "  vs nonshared    p50 4.00x   p90 3.00x  (goal >= 2x)",
        "  vs fullshared   p50 0.50x   p90 2.00x",
    ]


def test_serve_sweep_vllm_measurement_dirs(tmp_path):
    """--report-only reads the repeat-<n> directories in numeric order (else the root); a run
    measures into the root or repeat-1 .. repeat-N."""
    from serve_sweep_vllm import Bench, parse_args

    def roots(*argv):
        return Bench(parse_args(["-o", str(tmp_path), *argv]), None, None, []).roots()

    assert roots("--report-only") == [tmp_path]
    for name in ("repeat-10", "repeat-2", "repeat-1", "repeat-x"):
        (tmp_path / name).mkdir()
    assert roots("--report-only") == [tmp_path / f"repeat-{i}" for i in (1, 2, 10)]
    assert roots() == [tmp_path]
    assert roots("--repeats", "3") == [tmp_path / f"repeat-{i}" for i in (1, 2, 3)]
    b = Bench(
        parse_args(["--shared-tokens", "64, 32,", "--qps-factors", "0.5,2", "--engine-arg", "a=b=c"]), None, None, []
    )
    b.parse_lists()
    assert (b.lengths, b.factors, b.engine_options) == ([64, 32], [0.5, 2.0], {"a": "b=c"})
