"""serve-sweep: arrivals, percentiles, the event-driven queue, traces and replay, an end-to-end
sweep on a tiny random-weight model (fast), and one real-model sweep (slow)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.results.request import RequestRecord, SegmentRecord
from kvcmas_bench.results.stats import percentile
from kvcmas_bench.serving.arrivals import arrival_times, gaps
from kvcmas_bench.serving.queueing import simulate, wait_behind
from kvcmas_bench.serving.traces import CTX_SLOT, build_traces, load_traces, save_traces

from .conftest import VOCAB, tiny_model
from .sweep_helper import serve_sweep

TEXTS = [f"Question {i}: what is {i} plus {i * 7 % 13}? A. {i} B. {2 * i} C. {3 * i} D. none" for i in range(200)]


class FakeTokenizer:
    """Character-level ids in [3, VOCAB): enough for token-exact traces without a real tokenizer."""

    chat_template = None
    name_or_path = "fake-chars"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model gains nothing from threads, and on a shared 2-core machine intra-op threads
    spin against each other (orders of magnitude slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_lm():
    from kvcmas_bench.modeling import LoadedModel

    return LoadedModel(
        model=tiny_model("llama", layers=2), tokenizer=FakeTokenizer(), name="tiny-llama", source="tests"
    )


def quiet():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


# ---- arrivals ------------------------------------------------------------------------------------
def test_poisson_gaps_have_mean_one_over_qps():
    g = gaps(40_000, qps=4.0, burstiness=1.0, seed=1)
    assert g.mean() == pytest.approx(0.25, rel=0.02)
    # exponential: coefficient of variation 1
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.5, 3.0])
def test_gamma_gaps_shape_by_method_of_moments(burstiness):
    qps = 2.0
    g = gaps(60_000, qps=qps, burstiness=burstiness, seed=2)
    mean, var = g.mean(), g.var()
    assert mean == pytest.approx(1 / qps, rel=0.03)
    assert mean**2 / var == pytest.approx(burstiness, rel=0.05)  # shape k = mean^2 / var
    assert var / mean == pytest.approx(1 / (qps * burstiness), rel=0.05)  # scale = var / mean


def test_arrival_times_start_at_zero_and_qps0_is_single_stream():
    a = arrival_times(5, 2.0, seed=0)
    assert a[0] == 0 and np.all(np.diff(a) > 0) and len(a) == 5
    assert arrival_times(5, 0.0) is None
    # single stream: each trajectory starts when the previous one completes, nothing overlaps
    served = simulate([[(0.1, 0.5), (0.2, 1.0)]] * 3, None)
    firsts = [s for s in served if s.agent_index == 0]
    lasts = [s for s in served if s.agent_index == 1]
    assert [s.arrival_s for s in firsts] == pytest.approx([0.0, 1.5, 3.0])
    assert all(s.queue_s == 0 for s in served)
    assert [s.completion_s for s in lasts] == pytest.approx([1.5, 3.0, 4.5])
    with pytest.raises(BenchError):
        arrival_times(3, -1.0)
    with pytest.raises(BenchError):
        arrival_times(3, 1.0, burstiness=0)


def test_percentiles_interpolate_linearly():
    """Worked by hand: the q-th percentile of n sorted values sits at rank (n - 1) q / 100,
    interpolated linearly between its neighbours (numpy's default, as ``vllm bench serve`` uses)."""
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)  # rank 3.96
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None


# ---- queue -------------------------------------------------------------------------------------------
def test_queue_matches_hand_computed_example():
    # two trajectories of two agents; (ttft, e2e) measured in isolation
    service = [
        [(1.0, 2.0), (0.5, 3.0)],  # T0: A0, A1
        [(0.2, 1.0), (0.4, 2.0)],
    ]  # T1: B0, B1
    served = simulate(service, [0.0, 0.5])
    got = {(s.trajectory, s.agent_index): s for s in served}
    # A0 arrives 0, starts 0, first token 1, done 2. B0 arrived 0.5, waits, starts 2, done 3.
    # A1 arrives 2 (A0 done) but B0 arrived earlier (0.5): A1 starts 3, done 6. B1 arrives 3, starts 6, done 8.
    expect = {
        (0, 0): (0.0, 0.0, 1.0, 2.0),
        (1, 0): (0.5, 2.0, 2.2, 3.0),
        (0, 1): (2.0, 3.0, 3.5, 6.0),
        (1, 1): (3.0, 6.0, 6.4, 8.0),
    }
    for k, (arr, start, first, done) in expect.items():
        s = got[k]
        assert (s.arrival_s, s.start_s, s.first_token_s, s.completion_s) == pytest.approx((arr, start, first, done))
    assert [(s.trajectory, s.agent_index) for s in served] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert got[(1, 0)].ttft_s == pytest.approx(1.7) and got[(0, 1)].ttft_s == pytest.approx(1.5)
    assert got[(1, 1)].ttft_s == pytest.approx(3.4) and got[(1, 1)].e2e_s == pytest.approx(5.0)
    # idle server: far-apart arrivals never queue
    served = simulate(service, [0.0, 100.0])
    assert all(s.queue_s == 0 for s in served)


def test_waits_are_attributed_to_the_requests_being_served():
    # the example above: B0 waits 0.5..2 behind A0, A1 waits 2..3 behind B0, B1 waits 3..6 behind A1;
    # with A0 and A1 flagged (say, dense fallbacks) B0 waits 1.5 s behind flagged ones, A1 none, B1 3 s
    served = simulate([[(1.0, 2.0), (0.5, 3.0)], [(0.2, 1.0), (0.4, 2.0)]], [0.0, 0.5])
    flag = {(0, 0): True, (0, 1): True, (1, 0): False, (1, 1): False}
    got = wait_behind([(s.arrival_s, s.start_s, s.completion_s, flag[(s.trajectory, s.agent_index)]) for s in served])
    by = {(s.trajectory, s.agent_index): g for s, g in zip(served, got)}
    assert by == pytest.approx({(0, 0): 0.0, (1, 0): 1.5, (0, 1): 0.0, (1, 1): 3.0})
    # flagging everything attributes every wait whole; a wait partly covered counts only its overlap
    every = wait_behind([(s.arrival_s, s.start_s, s.completion_s, True) for s in served])
    assert every == pytest.approx([s.queue_s for s in served])
    assert wait_behind([(0.0, 0.0, 2.0, True), (1.5, 2.0, 3.0, False)]) == pytest.approx([0.0, 0.5])


# ---- traces --------------------------------------------------------------------------------------
def test_traces_have_the_specified_structure_and_lengths():
    tok = FakeTokenizer()
    trs = build_traces(tok, 3, shared_tokens=50, output_tokens=7, seed=3, calib_trajectories=2, texts=TEXTS)
    ev = [t for t in trs if t.split == "eval"]
    cal = [t for t in trs if t.split == "calibration"]
    assert len(ev) == 3 and len(cal) == 2
    names = [a.name for a in ev[0].agents]
    assert len(names) == 4
    outputs = {n: [5 + i] * 7 for i, n in enumerate(names)}
    for tr in trs:
        assert len(tr.context_ids) == 50 and tr.output_tokens == 7
        for i in range(len(tr.agents)):
            req = tr.request(i, outputs)
            kinds = [(s.kind, s.slot) for s in req.segments]
            expect = [("PF", None), ("PH", CTX_SLOT)]
            for up in names[:i]:
                expect += [("PF", None), ("PH", f"out:{up}")]
            expect.append(("PF", None))
            assert kinds == expect
            assert req.segments[1].ids == tr.context_ids and req.max_new_tokens == 7
            assert len(req.prompt_ids) == tr.nominal_prompt_tokens(i)
            assert req.segments[-1].name == "tail" and req.segments[0].name == "sys"
    # PF_sys differs per agent; the shared context differs per trajectory; calibration is disjoint
    assert len({tuple(a.segments[0]["ids"]) for a in ev[0].agents}) == 4
    assert len({tuple(t.context_ids) for t in trs}) == 5
    used_ev = {i for t in ev for i in t.meta["text_indices"]}
    used_cal = {i for t in cal for i in t.meta["text_indices"]}
    assert not used_ev & used_cal
    # same seed, same traces; accumulated variant: 3 x per-agent outputs over a fixed context
    again = build_traces(tok, 3, shared_tokens=50, output_tokens=7, seed=3, calib_trajectories=2, texts=TEXTS)
    assert [t.to_dict() for t in again] == [t.to_dict() for t in trs]
    acc = build_traces(tok, 1, shared_tokens=30, seed=0, accumulated=True, context_tokens=40, texts=TEXTS)[0]
    assert acc.output_tokens == 10 and len(acc.context_ids) == 40 and acc.accumulated


def test_replaying_a_saved_trace_gives_identical_requests(tmp_path, engine):
    from kvcmas_bench.methods import get_method
    from kvcmas_bench.serving.engines import InProcessEngine

    tok = FakeTokenizer()
    trs = build_traces(tok, 2, shared_tokens=40, output_tokens=4, seed=1, calib_trajectories=1, texts=TEXTS)
    path = tmp_path / "traces.jsonl"
    save_traces(trs, path)
    back = load_traces(path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in trs]
    outputs = {a.name: [7, 8, 9, 10] for a in trs[0].agents}
    for a, b in zip(trs, back):
        for i in range(4):
            ra, rb = a.request(i, outputs), b.request(i, outputs)
            assert [(s.kind, s.slot, s.ids, s.name) for s in ra.segments] == [
                (s.kind, s.slot, s.ids, s.name) for s in rb.segments
            ]
            assert ra.max_new_tokens == rb.max_new_tokens
    # and the engine produces the same generated outputs from both
    backend = InProcessEngine(engine.model, tok)
    m = get_method("fullshared")
    ra = backend.run_trajectory(trs[0], m)
    rb = backend.run_trajectory(back[0], m)
    assert [s.result.output_ids for s in ra.steps] == [s.result.output_ids for s in rb.steps]
    assert all(len(s.result.output_ids) == 4 for s in ra.steps)  # EOS ignored: exactly output_tokens
    with pytest.raises(BenchError):
        load_traces(tmp_path / "missing.jsonl")


# ---- end to end ----------------------------------------------------------------------------------
def test_small_sweep_writes_summary_requests_and_plots(tmp_path, tiny_lm):
    out = tmp_path / "sweep"
    summary = serve_sweep(
        ["nonshared", "kvcmas"],
        [0, 2.0],
        [48],
        3,
        str(out),
        model=tiny_lm,
        output_tokens=4,
        device="cpu",
        calib_trajectories=2,
        texts=TEXTS,
        console=quiet(),
        progress=lambda m: None,
    )
    for f in (
        "config.json",
        "traces.jsonl",
        "service.jsonl",
        "requests.jsonl",
        "summary.json",
        "ttft_p50.png",
        "ttft_p90.png",
    ):
        assert (out / f).exists(), f
    rows = summary["rows"]
    assert {(r["method"], r["qps"]) for r in rows} == {(m, q) for m in ("nonshared", "kvcmas") for q in (0.0, 2.0)}
    saved = json.loads((out / "summary.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and "one request at a time" in saved["server"]
    reqs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 2 * 2 * 3 * 4
    for r in rows:
        mine = [x for x in reqs if x["method"] == r["method"] and x["qps"] == r["qps"]]
        assert r["ttft_p90_s"] == pytest.approx(float(np.percentile([x["ttft_s"] for x in mine], 90)))
        assert r["peak_mem_bytes"] > 0 and r["kv_state_peak_bytes"] > 0
        assert r["output_tokens_mean"] == 4
    ns = {r["qps"]: r for r in rows if r["method"] == "nonshared"}
    # single stream: no queueing, TTFT under load == measured TTFT
    assert ns[0.0]["ttft_mean_s"] == pytest.approx(ns[0.0]["service_ttft_mean_s"])
    assert ns[2.0]["utilization"] == pytest.approx(2.0 * ns[2.0]["trajectory_service_mean_s"])
    assert ns[0.0]["reuse_ratio"] == 0.0  # eligible shared tokens, none reused
    # the agents after the first reuse something under KVCMAS only once the warm pools accept;
    # either way the shared segments are eligible and the first agent of each trajectory is dense
    svc = [json.loads(x) for x in (out / "service.jsonl").read_text().splitlines()]
    assert all(s["reused_tokens"] == 0 for s in svc if s["step"] == 0)
    assert all(s["eligible_tokens"] > 0 for s in svc if s["step"] > 0 and s["method"] == "kvcmas")
    # without --matched-rho nothing is scheduled: traces saved as before, no rho target
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["matched_rho"] is None and "rho_schedule" not in cfg and cfg["method_args"] == {}
    assert cfg["method_resolved"]["kvcmas"] == {"svd": "gram"}  # what svd=auto chose on the CPU
    assert all("schedule" not in json.loads(x) for x in (out / "traces.jsonl").read_text().splitlines())
    assert all(r["rho_target"] is None for r in rows) and saved["matched_rho"] is None
    assert not any(seg.get("gate", "").startswith("scheduled") for s in svc for seg in s["segments"])
    # every point says where its TTFT goes (own service + queueing), adding up
    for r in rows:
        assert r["ttft_p50_queue_s"] + r["ttft_p50_service_s"] == pytest.approx(r["ttft_p50_s"])
        assert r["ttft_mean_service_s"] == pytest.approx(r["service_ttft_mean_s"])

    # re-running into the same directory reuses the measurements; other QPS values only re-sweep
    from kvcmas_bench.jobs.sweep import evaluate_service

    again = serve_sweep(
        ["nonshared"],
        [1.0],
        [48],
        3,
        str(out),
        model=tiny_lm,
        output_tokens=4,
        device="cpu",
        texts=TEXTS,
        console=quiet(),
        progress=lambda m: None,
    )
    assert again["rows"][0]["service_e2e_mean_s"] == ns[0.0]["service_e2e_mean_s"]
    re = evaluate_service(str(out), [0.5, 4.0], console=quiet())
    assert {r["qps"] for r in re["rows"]} == {0.5, 4.0}

    # replay from the saved trace file
    replay = serve_sweep(
        ["fullshared"],
        [0],
        [],
        2,
        str(tmp_path / "replay"),
        model=tiny_lm,
        output_tokens=4,
        traces_path=str(out / "traces.jsonl"),
        console=quiet(),
        progress=lambda m: None,
    )
    assert replay["rows"][0]["n_trajectories"] == 2


def test_saturated_points_are_flagged_with_the_qps_nonshared_sustains(tmp_path, tiny_lm):
    from rich.console import Console

    from kvcmas_bench.jobs.sweep import evaluate_service

    kw = dict(model=tiny_lm, output_tokens=2, device="cpu", texts=TEXTS, console=quiet(), progress=lambda m: None)
    serve_sweep(["nonshared", "fullshared"], [0], [24], 2, str(tmp_path / "s"), plots=False, **kw)
    con = Console(width=80, file=io.StringIO(), record=True)
    s = evaluate_service(str(tmp_path / "s"), [0, 1e-3, 1e4], plots=True, console=con)
    ns = {r["qps"]: r for r in s["rows"] if r["method"] == "nonshared"}
    assert ns[1e4]["saturated"] and not ns[1e-3]["saturated"] and not ns[0.0]["saturated"]
    cap = s["capacity"][24]
    assert cap["nonshared_capacity_qps"] == pytest.approx(1 / ns[0.0]["trajectory_service_mean_s"])
    assert cap["nonshared_max_stable_qps"] == 1e-3
    assert {(x["method"], x["qps"]) for x in s["saturated"]} == {("nonshared", 1e4), ("fullshared", 1e4)}
    text = con.export_text()
    assert "…" not in text and "saturated" in text and "NonShared sustains <" in text
    assert text.count("!") >= 2  # the two saturated rows are marked in the util column
    assert (tmp_path / "s" / "ttft_p50.svg").exists()


def test_a_sweep_written_with_the_old_backend_key_resumes_and_another_engine_is_refused(tmp_path, tiny_lm):
    out = tmp_path / "old"
    said = []
    kw = dict(model=tiny_lm, output_tokens=2, device="cpu", texts=TEXTS, console=quiet(), plots=False)
    first = serve_sweep(["nonshared"], [0], [24], 1, str(out), progress=lambda m: None, **kw)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["engine"] == "in-process" and "backend" not in cfg and first["engine"] == "in-process"
    # a directory written before the config key was named engine
    old = {("backend" if k == "engine" else k): v for k, v in cfg.items()}
    cfg_path.write_text(json.dumps(old))
    again = serve_sweep(["nonshared"], [0], [24], 1, str(out), progress=said.append, **kw)
    assert "nonshared @ 24 shared tokens: reusing saved measurements" in said
    assert again["rows"][0]["service_e2e_mean_s"] == first["rows"][0]["service_e2e_mean_s"]
    assert again["engine"] == "in-process" and json.loads(cfg_path.read_text())["engine"] == "in-process"
    # measured on another engine: refused, whichever key names it
    cfg_path.write_text(json.dumps({**old, "backend": "vllm"}))
    with pytest.raises(BenchError, match=r"different engine \('vllm' vs 'in-process'\)"):
        serve_sweep(["nonshared"], [0], [24], 1, str(out), progress=lambda m: None, **kw)


def test_chained_plot_and_input_errors(tmp_path, tiny_lm):
    kw = dict(model=tiny_lm, output_tokens=2, device="cpu", texts=TEXTS, console=quiet(), progress=lambda m: None)
    s = serve_sweep(["kvcmas", "kvcmas-nonchained"], [0, 1.0], [24], 1, str(tmp_path / "c"), **kw)
    assert "chained_ttft_p50.png" in s["plots"] and (tmp_path / "c" / "chained_ttft_p90.png").exists()
    # accumulated-output variant: 6 accumulated tokens = 2 per agent over a fixed 16-token context
    a = serve_sweep(
        ["nonshared"], [0], [6], 1, str(tmp_path / "a"), accumulated=True, context_tokens=16, plots=False, **kw
    )
    assert a["rows"][0]["output_tokens_mean"] == 2 and a["accumulated"] is True
    with pytest.raises(BenchError, match="other traces"):
        serve_sweep(["nonshared"], [0], [7], 1, str(tmp_path / "a"), accumulated=True, context_tokens=16, **kw)
    with pytest.raises(BenchError, match="unknown method"):
        serve_sweep(["nope"], [0], [16], 1, str(tmp_path / "e"), **kw)
    with pytest.raises(BenchError, match="qps"):
        serve_sweep(["nonshared"], [-1], [16], 1, str(tmp_path / "e"), **kw)
    with pytest.raises(BenchError, match="max_position_embeddings"):
        serve_sweep(["nonshared"], [0], [4090], 1, str(tmp_path / "e"), **kw)
    with pytest.raises(BenchError, match="trajectories"):
        serve_sweep(["nonshared"], [0], [16], 0, str(tmp_path / "e"), **kw)
    with pytest.raises(BenchError, match="--warmup-trajectories must be >= 0, got -1"):
        serve_sweep(["nonshared"], [0], [16], 1, str(tmp_path / "e"), warmup_trajectories=-1, **kw)
    assert not (tmp_path / "e").exists()


def test_request_record_roundtrip():
    r = RequestRecord("Reader", 0.1, 0.2, trajectory="t", step=0, segments=[SegmentRecord(kind="PF", tokens=3)])
    assert RequestRecord.from_dict(r.to_dict()) == r


# ---- real model ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_sweep_nonshared_vs_kvcmas(tmp_path):
    from kvcmas_bench.modeling import load_model

    lm = load_model(None)
    s = serve_sweep(
        ["nonshared", "kvcmas"],
        [0, 4],
        [256],
        2,
        str(tmp_path / "real"),
        model=lm,
        output_tokens=16,
        device="cpu",
        calib_trajectories=2,
        console=quiet(),
        progress=lambda m: None,
    )
    rows = {(r["method"], r["qps"]): r for r in s["rows"]}
    assert len(rows) == 4
    for r in rows.values():
        assert r["output_tokens_mean"] == 16 and r["ttft_p50_s"] > 0
        assert r["prompt_tokens_mean"] > 256
    # queueing never makes TTFT shorter than in single stream on the same measurements
    for m in ("nonshared", "kvcmas"):
        assert rows[(m, 4.0)]["ttft_mean_s"] >= rows[(m, 0.0)]["ttft_mean_s"] - 1e-9


def test_warmup_trajectories_are_served_before_measurement_and_excluded(tmp_path, tiny_lm):
    kw = dict(
        model=tiny_lm,
        output_tokens=2,
        device="cpu",
        texts=TEXTS,
        console=quiet(),
        progress=lambda m: None,
        calib_trajectories=1,
        method_args={"tau": 1.0},
        plots=False,
    )
    cold = serve_sweep(["kvcmas"], [0], [24], 2, str(tmp_path / "cold"), **kw)
    warm = serve_sweep(["kvcmas"], [0], [24], 2, str(tmp_path / "warm"), warmup_trajectories=3, **kw)
    cfg = json.loads((tmp_path / "warm" / "config.json").read_text())
    warm_ids = cfg["warmup_trajectories"]["24"]
    assert len(warm_ids) == 3 and not set(warm_ids) & set(cfg["calibration_trajectories"]["24"])
    splits = [json.loads(x)["split"] for x in (tmp_path / "warm" / "traces.jsonl").read_text().splitlines()]
    assert splits.count("warmup") == 3 and splits.count("eval") == 2
    reqs = [json.loads(x) for x in (tmp_path / "warm" / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 2 * 4 and not {r["trajectory"] for r in reqs} & set(warm_ids)  # excluded from statistics
    # pools in steady state: the measured trajectories reuse more than after a cold start
    assert warm["rows"][0]["reuse_ratio"] > cold["rows"][0]["reuse_ratio"]


@pytest.mark.parametrize(
    "methods,says",
    [("nonshared,droidspeak", "cannot run droidspeak: it enters layers"), ("nonshared,nosuch", "unknown method")],
)
def test_vllm_benchmark_refuses_a_method_the_server_cannot_run_before_it_measures(tmp_path, methods, says):
    """The script measures the in-process engine first (tens of minutes); a method the vLLM server
    refuses must fail at once, with one line and exit code 2, and leave nothing measured."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_sweep_vllm.py"
    out = tmp_path / "bench"
    p = subprocess.run(
        [sys.executable, str(script), "--methods", methods, "-o", str(out)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("serve_sweep_vllm: error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in p.stderr
    assert not out.exists()
