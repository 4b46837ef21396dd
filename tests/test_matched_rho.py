"""serve-sweep --matched-rho: one seeded schedule of dense/reuse decisions per set of trajectories,
the same for every method, reaching the target rho on each eligibility family; the recomputation
methods get their rho knob; and where the TTFT goes (own service vs queueing, the queueing behind
dense fallbacks)."""

from __future__ import annotations

import json

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.jobs.sweep import RHO_PRESETS, parse_matched_rho
from kvcmas_bench.results.request import RequestRecord
from kvcmas_bench.serving.metrics import request_parts
from kvcmas_bench.serving.traces import (
    ROLES,
    apply_schedule,
    build_traces,
    dense_transitions,
    draw_schedule,
    load_traces,
    save_traces,
    scheduled_rho,
    shared_segments,
)

from .conftest import run_cli
from .sweep_helper import serve_sweep
from .test_serving import TEXTS, FakeTokenizer, one_thread, quiet, tiny_lm  # noqa: F401  (fixtures)


def _traces(n, shared=8, out=8, roles=ROLES, calib=0):
    return build_traces(
        FakeTokenizer(),
        n,
        shared_tokens=shared,
        output_tokens=out,
        seed=0,
        texts=TEXTS,
        roles=roles,
        calib_trajectories=calib,
    )


# ---- the schedule, counted by hand ---------------------------------------------------------------
def test_ten_equal_segments_at_rho_08_make_two_dense():
    # two agents: the first one's context has no source (reference-only stratum); the second one's
    # context and the first one's output have one: 5 trajectories x 2 = 10 equal source segments
    trs = _traces(5, roles=ROLES[:2])
    segs = [s for t in trs for s in shared_segments(t)]
    assert sum(s.stratum == "source" for s in segs) == 10 and sum(s.stratum == "reference" for s in segs) == 5
    assert {s.tokens for s in segs} == {8}
    apply_schedule(trs, 0.8, seed=0)
    dense = dense_transitions(trs)
    assert sum(d[3] == "source" for d in dense) == 2  # 0.2 x 10
    assert sum(d[3] == "reference" for d in dense) == 1  # 0.2 x 5
    assert scheduled_rho(trs) == {"source": pytest.approx(0.8), "reference": pytest.approx(0.8)}
    # four agents, 5 trajectories: 45 source segments (9 dense), 5 reference-only ones (1 dense)
    trs = _traces(5)
    apply_schedule(trs, 0.8, seed=3)
    dense = dense_transitions(trs)
    assert (sum(d[3] == "source" for d in dense), sum(d[3] == "reference" for d in dense)) == (9, 1)
    assert all(d[1] == 0 and d[2] == "ctx" for d in dense if d[3] == "reference")
    # deterministic in (traces, rho, seed); every shared slot of every agent gets a decision
    assert draw_schedule(trs, 0.8, seed=3) == {t.id: t.schedule for t in trs}
    assert draw_schedule(trs, 0.8, seed=4) != draw_schedule(trs, 0.8, seed=3)
    for t in trs:
        assert [set(d) for d in t.schedule] == [set(a.slots) for a in t.agents]
    # rho 1: nothing dense; rho 0: everything
    apply_schedule(trs, 1.0)
    assert dense_transitions(trs) == []
    apply_schedule(trs, 0.0)
    assert len(dense_transitions(trs)) == 50


def test_unequal_segments_are_scheduled_as_close_as_whole_segments_allow():
    # one trajectory, context 40 tokens, outputs 8: source stratum = 3 contexts + 6 outputs = 168
    # tokens, 0.2 of it = 33.6: no context fits, four outputs do (32), a fifth would overshoot more
    # (40 - 33.6 = 6.4 > 1.6); the reference stratum (one 40-token context, target 8) stays reused
    (tr,) = _traces(1, shared=40, out=8)
    apply_schedule([tr], 0.8)
    dense = dense_transitions([tr])
    assert len(dense) == 4 and all(d[2].startswith("out:") for d in dense)
    assert scheduled_rho([tr]) == {"source": pytest.approx(1 - 32 / 168), "reference": pytest.approx(1 - 32 / 208)}


def test_requests_carry_the_schedule_and_unscheduled_traces_are_saved_as_before(tmp_path):
    trs = _traces(2)
    plain = [t.to_dict() for t in trs]
    assert all("schedule" not in d for d in plain)
    outputs = {a.name: [5] * 8 for a in trs[0].agents}
    assert all(s.schedule is None for i in range(4) for s in trs[0].request(i, outputs).segments)
    apply_schedule(trs, 0.6, seed=1)
    for t in trs:
        for i in range(4):
            ph = [s for s in t.request(i, outputs).segments if s.kind == "PH"]
            assert [s.schedule for s in ph] == [t.schedule[i][s.slot] for s in ph]
    save_traces(trs, tmp_path / "t.jsonl")
    back = load_traces(tmp_path / "t.jsonl")
    assert [t.schedule for t in back] == [t.schedule for t in trs]
    apply_schedule(trs, None)
    assert [t.to_dict() for t in trs] == plain
    bad = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    bad["schedule"][1]["ctx"] = "maybe"
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(BenchError, match="not a valid serving trace"):
        load_traces(tmp_path / "bad.jsonl")


def test_the_vllm_flow_builds_its_requests_with_the_schedule():
    """--engine vllm plans every agent request from the same Trace.request (no vLLM needed here)."""
    import torch

    from kvcmas_bench.methods import get_method
    from kvcmas_bench.serving.vllm.flow import ModelFacts, PlanContext, Runtime, TrajectoryRun

    (tr,) = _traces(1)
    apply_schedule([tr], 0.0)  # every shared segment dense
    facts = ModelFacts(torch.ones(2), 1, 1, 4, torch.float32, "cpu")
    run = TrajectoryRun(Runtime(facts), tr, get_method("fullshared"), capture_outputs=True)
    run.begin(0.0)
    seg = run.agent.request.segments[1]
    assert seg.kind == "PH" and seg.schedule == "dense"
    assert PlanContext(facts, run.agent.request, seg, 0, None).forced == "dense"


def test_parse_and_refusals(tmp_path):
    assert parse_matched_rho("paper-0.8").config() == {"delta": 0.8, "recompute": 0.9}
    assert parse_matched_rho("paper-0.6").config() == {"delta": 0.6, "recompute": 0.8}
    assert RHO_PRESETS == {"paper-0.8": (0.8, 0.9), "paper-0.6": (0.6, 0.8)}
    assert parse_matched_rho("0.7").config() == {"delta": 0.7, "recompute": 0.7}
    assert parse_matched_rho("0.8, 0.85").config() == {"delta": 0.8, "recompute": 0.85}
    assert parse_matched_rho(None) is None
    for bad in ("x", "1.5", "0.8,0.9,0.7", ""):
        with pytest.raises(BenchError, match="matched-rho"):
            parse_matched_rho(bad)
    # refused in one line before any model loads
    out = str(tmp_path / "o")
    assert run_cli(["serve-sweep", "--matched-rho", "paper-1", "--qps", "0", "-o", out]) == 2
    assert run_cli(["serve-sweep", "--matched-rho", "0.8", "--rho", "0.9", "--qps", "0", "-o", out]) == 2


# ---- end to end ----------------------------------------------------------------------------------
def _sweep(tiny_lm, out, methods, matched="paper-0.8", **kw):  # noqa: F811
    args = dict(
        model=tiny_lm,
        output_tokens=8,
        device="cpu",
        texts=TEXTS,
        console=quiet(),
        progress=lambda m: None,
        calib_trajectories=2,
    )
    args.update(kw)
    return serve_sweep(methods, [0, 4.0], [8], 5, str(out), matched_rho=matched, **args)


def _service(out):
    return [RequestRecord.from_dict(json.loads(x)) for x in (out / "service.jsonl").read_text().splitlines()]


def test_matched_sweep_reaches_the_target_rho_with_one_schedule_for_every_method(tmp_path, tiny_lm):  # noqa: F811
    out = tmp_path / "m"
    s = _sweep(tiny_lm, out, ["nonshared", "fullshared", "graphflow", "kvcmas", "kvcomm", "cacheblend"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["matched_rho"] == {"delta": 0.8, "recompute": 0.9} and cfg["rho_preset"] == "paper-0.8"
    assert cfg["method_args"] == {} and cfg["method_configs"]["cacheblend"]["rho"] == 0.9
    sched = cfg["rho_schedule"]["8"]
    assert sched["scheduled_rho"] == {"source": pytest.approx(0.8), "reference": pytest.approx(0.8)}
    dense = {tuple(d[:3]) for d in sched["dense"]}
    src_dense = {tuple(d[:3]) for d in sched["dense"] if d[3] == "source"}
    # the traces file records the schedule of the evaluated trajectories (held-out ones: none)
    for line in (out / "traces.jsonl").read_text().splitlines():
        t = json.loads(line)
        assert ("schedule" in t) == (t["split"] == "eval")
    rows = {(r["method"], r["qps"]): r for r in s["rows"]}
    # realized rho from the request records = the target for the methods that follow the schedule:
    # FullShared and KVCMAS (source-eligible segments; KVCMAS's pools hold an anchor for every
    # relation after the two held-out trajectories), GraphFlow (every shared segment)
    for m in ("fullshared", "graphflow", "kvcmas"):
        for q in (0.0, 4.0):
            assert rows[(m, q)]["reuse_ratio"] == pytest.approx(0.8) and rows[(m, q)]["rho_target"] == 0.8
    # KVComm recomputes layer 0 exactly (counted as recomputation): 0.8 x (L - 1) / L with L = 2
    assert rows[("kvcomm", 0.0)]["reuse_ratio"] == pytest.approx(0.4)
    assert rows[("cacheblend", 0.0)]["rho_target"] == 0.9 and rows[("nonshared", 0.0)]["rho_target"] is None
    # the same schedule for every method: the eligible segments prefilled densely are the scheduled ones
    by_method: dict[str, set] = {}
    for r in _service(out):
        for seg in r.segments:
            if seg.kind == "PH" and seg.eligible and seg.status == "exact":
                by_method.setdefault(r.method, set()).add((r.trajectory, r.step, seg.slot))
    assert by_method["fullshared"] == by_method["kvcmas"] == src_dense
    assert by_method["graphflow"] == by_method["kvcomm"] == dense
    assert "ttft_parts.png" in s["plots"] and (out / "ttft_parts.svg").exists()
    # resuming with another matched rho is refused (the schedule is part of what was measured)
    with pytest.raises(BenchError, match="matched_rho"):
        _sweep(tiny_lm, out, ["fullshared"], matched="paper-0.6")


def test_kvcmas_reuses_less_than_scheduled_until_its_pools_hold_an_anchor(tmp_path, tiny_lm):  # noqa: F811
    # no held-out trajectories: the first trajectory's relations have no anchor yet, so a scheduled
    # "reuse" falls back to dense there (and the dense prefill gives the anchor); later ones reach it
    cold = _sweep(tiny_lm, tmp_path / "cold", ["kvcmas"], calib_trajectories=0, plots=False)
    rho = cold["rows"][0]["reuse_ratio"]
    assert rho < 0.8
    svc = _service(tmp_path / "cold")
    first = [r for r in svc if r.trajectory == svc[0].trajectory]
    assert all(r.reused_tokens == 0 for r in first)


def test_ttft_parts_add_up_per_request_and_per_percentile(tmp_path, tiny_lm):  # noqa: F811
    out = tmp_path / "p"
    s = _sweep(tiny_lm, out, ["nonshared", "kvcmas"], plots=False)
    reqs = [RequestRecord.from_dict(json.loads(x)) for x in (out / "requests.jsonl").read_text().splitlines()]
    for row in s["rows"]:
        served = [r for r in reqs if r.method == row["method"] and r.qps == row["qps"]]
        for r, p in zip(served, request_parts(served)):
            assert r.queue_s + r.service_ttft_s == pytest.approx(r.ttft_s, abs=1e-9)
            assert p["queue"] + p["service"] == pytest.approx(r.ttft_s, abs=1e-9)
            assert p["queue_dense"] + p["queue_other"] == pytest.approx(p["queue"], abs=1e-12)
            assert 0 <= p["queue_dense"] <= p["queue"] + 1e-12
            parts = p["service_shared_dense"] + p["service_shared_reuse"] + p["service_other"]
            assert parts == pytest.approx(p["service"], abs=1e-12)
        for stat in ("p50", "p90", "mean"):
            total = row[f"ttft_{stat}_s"]
            assert row[f"ttft_{stat}_queue_s"] + row[f"ttft_{stat}_service_s"] == pytest.approx(total, abs=1e-9)
            assert row[f"ttft_{stat}_queue_dense_s"] + row[f"ttft_{stat}_queue_other_s"] == pytest.approx(
                row[f"ttft_{stat}_queue_s"], abs=1e-9
            )
        if row["qps"] == 0:
            assert row["ttft_p90_queue_s"] == 0 and row["queue_dense_share"] is None
        else:
            q = sum(r.queue_s for r in served)
            assert row["queue_dense_share"] == pytest.approx(sum(p["queue_dense"] for p in request_parts(served)) / q)
