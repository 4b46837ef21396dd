"""Tensor parallelism of the vLLM connector's worker side without vLLM: a fake two-rank layout.

Each "rank" is a thread holding half of the tiny model's KV heads (its caches are the head slice
of the single-device caches, as a rank's paged cache is under vLLM); their ``reduce_heads`` is an
in-process all-reduce (:class:`Exchange`) standing in for the gloo group of :mod:`~kvcmas_bench.
serving.vllm.tp`. KVCMAS and KVComm gate and correct on each half; the concatenated K/V and the
gate decisions must equal the single-device run's (exact anchors: full-dimensional, or low-rank at
a rank that covers every dimension), and with truncated per-rank anchors both ranks still take one
decision from the same reduced distances.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest
import torch

from kvcmas_bench.errors import BenchError
from kvcmas_bench.methods import get_method
from kvcmas_bench.segments import Request, Segment, SegmentKV
from kvcmas_bench.serving.vllm.flow import ModelFacts, PlanContext
from kvcmas_bench.serving.vllm.http import cpu_thread_bind
from kvcmas_bench.serving.vllm.tp import HeadShards, kv_head_range, parallel_refusal

from .conftest import rand_ids


class Exchange:
    """An all-reduce among ``n`` threads (each calls ``fn(rank)(tensor, op)`` in the same order),
    the result computed once and handed to every rank, as gloo does."""

    def __init__(self, n: int):
        self.n, self.slots, self.result = n, [None] * n, None
        self.barrier = threading.Barrier(n, timeout=60)
        self.calls = [0] * n

    def fn(self, rank: int):
        def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            self.calls[rank] += 1
            self.slots[rank] = t.detach().clone()
            if self.barrier.wait() == 0:
                stack = torch.stack(self.slots)  # ranks reducing tensors of different shapes fail here
                self.result = stack.sum(0) if op == "sum" else stack.max(0).values
            self.barrier.wait()
            out = self.result.clone()
            self.barrier.wait()
            return out

        return all_reduce


def on_ranks(n: int, fn):
    """``fn(rank, shards)`` on ``n`` threads sharing an :class:`Exchange`; their results by rank."""
    ex = Exchange(n)
    out, errors = [None] * n, []

    def run(r):
        try:
            out[r] = fn(r, ex.fn(r))
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(exc)
            ex.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out, ex


# ---- vLLM's KV-head sharding ----------------------------------------------------------------------
def test_kv_head_ranges_follow_vllms_sharding():
    # H >= W: rank r holds [r H/W, (r+1) H/W)
    assert [kv_head_range(8, 2, r) for r in range(2)] == [(0, 4, 1), (4, 8, 1)]
    assert [kv_head_range(2, 2, r) for r in range(2)] == [(0, 1, 1), (1, 2, 1)]
    # H < W: one head per rank, head r // (W / H), replicated on W / H ranks
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1, 2), (0, 1, 2), (1, 2, 2), (1, 2, 2)]
    assert [kv_head_range(1, 2, r)[:2] for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(BenchError):
        kv_head_range(3, 2, 0)
    with pytest.raises(BenchError):
        kv_head_range(2, 3, 0)
    s = HeadShards(1, 4, 2, lambda t, op: t)
    assert (s.heads, s.count, s.replicas, s.publishes) == (1, 2, 2, False)


def test_the_served_models_kv_width_is_one_ranks_heads():
    from types import SimpleNamespace

    from kvcmas_bench.serving.vllm.inprocess import ServedModel

    def width(heads, attn, hidden, head_dim, tp):
        m = ServedModel()
        m.config = SimpleNamespace(
            num_key_value_heads=heads, num_attention_heads=attn, hidden_size=hidden, head_dim=head_dim
        )
        m.opts = SimpleNamespace(tensor_parallel_size=tp)
        return m.kv_width

    assert width(3, 9, 576, 64, 1) == 192  # SmolLM2-135M: 3 KV heads of 64
    assert width(3, 9, 576, 64, 3) == 64  # one head per rank
    assert width(3, 9, 576, 64, 6) == 64  # a head replicated on two ranks
    assert width(8, 32, 4096, None, 2) == 512  # Llama-3.1-8B: head_dim 4096 / 32 = 128, 4 heads per rank


def test_replicated_heads_count_once_in_the_reduction():
    """H = 1 KV head on W = 2 ranks: both hold the same head; the sum over ranks is halved."""

    def rank(r, all_reduce):
        s = HeadShards(r, 2, 1, all_reduce)
        return s.reduce(torch.tensor([3.0, 5.0])), s.count

    out, _ = on_ranks(2, rank)
    assert all(torch.equal(x, torch.tensor([3.0, 5.0])) and c == 1 for x, c in out)


def test_parallel_layouts_the_connector_refuses_and_cpu_binding():
    @dataclass
    class PC:
        tensor_parallel_size: int = 1
        pipeline_parallel_size: int = 1
        decode_context_parallel_size: int = 1
        prefill_context_parallel_size: int = 1

    assert parallel_refusal(PC(tensor_parallel_size=4)) is None
    assert "pipeline_parallel_size 2" in parallel_refusal(PC(pipeline_parallel_size=2))
    assert "decode_context_parallel_size" in parallel_refusal(PC(decode_context_parallel_size=2))
    one = cpu_thread_bind(1)
    assert "|" not in one and one != "nobind"
    assert cpu_thread_bind(10_000) == "nobind"


# ---- the delta methods on a fake two-rank layout ---------------------------------------------------
N_STEPS = 8


@pytest.fixture(scope="module")
def steps(engine):
    """Per step: a shared segment ``q``, its source cache (agent A after its own prefix), agent B's
    exact cache of it after B's prefix, and its context-free reference."""
    from kvcmas_bench.methods import get_method as gm

    assert engine.n_kv == 2  # one head per rank
    pb = rand_ids(7, 500)
    out = []
    for i in range(N_STEPS):
        q = rand_ids(12, 600 + i)
        ra = Request("A", [Segment("PF", rand_ids(5 + i, 700 + i)), Segment("PH", q, slot="q"), Segment("PF", [5])], 1)
        rb = Request("B", [Segment("PF", pb), Segment("PH", q, slot="q"), Segment("PF", [6])], 1)
        src = engine.run(ra, gm("nonshared")).materialized["q"]
        exact = engine.run(rb, gm("nonshared")).materialized["q"]
        ref = engine.prefill_alone(q, slot="q")
        out.append((rb, src, exact, ref))
    return out


def _heads(kv: SegmentKV, hs: slice) -> SegmentKV:
    """The rank's share of a cache: its heads, same identity (uid) as the whole cache."""
    return SegmentKV(k=kv.k[:, hs].clone(), v=kv.v[:, hs].clone(), start=kv.start, ids=kv.ids, slot=kv.slot, uid=kv.uid)


def _serve(engine, steps, method, hs: slice, shards: HeadShards | None):
    """The worker's planning of each step with ``method`` on heads ``hs``: a dense segment is the
    placeholder vLLM fills (here: with the exact cache's heads), then its deferred anchor update runs."""
    facts = ModelFacts(
        engine.inv_freq, engine.n_layers, hs.stop - hs.start, engine.head_dim, torch.float32, "cpu", True, shards
    )
    got = []
    for rb, src, exact, ref in steps:
        facts.ready[tuple(ref.ids)] = _heads(ref, hs)
        seg = rb.segments[1]
        ctx = PlanContext(facts, rb, seg, len(rb.segments[0].ids), _heads(src, hs))
        kv = method.materialize(ctx)
        if any(kv is p for p in ctx.placeholders):
            kv.k.copy_(exact.k[:, hs])
            kv.v.copy_(exact.v[:, hs])
            for fn in ctx.deferred:
                fn()
        got.append((kv.status, dict(ctx.details), kv.k.clone(), kv.v.clone()))
    return got


def _sharded(engine, steps, make):
    def rank(r, all_reduce):
        return _serve(engine, steps, make(), slice(r, r + 1), HeadShards(r, 2, 2, all_reduce))

    return on_ranks(2, rank)


def _same_decisions(a: dict, b: dict, exact: bool):
    assert a.get("gate") == b.get("gate") and a.get("fallback") == b.get("fallback")
    assert a.get("anchors_used") == b.get("anchors_used") and a.get("compare_tokens") == b.get("compare_tokens")
    for key in ("entropy",):
        if a.get(key) is not None:
            assert (a[key] == b[key]) if exact else math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6)
    if a.get("distances") is not None:
        if exact:
            assert a["distances"] == b["distances"]
        else:
            assert all(math.isclose(x, y, rel_tol=1e-4) for x, y in zip(a["distances"], b["distances"], strict=True))


METHODS = {
    # low-rank anchors at a rank covering every dimension (the per-rank factorization is then exact)
    "kvcmas-full-rank": lambda tau: get_method("kvcmas", anchors=3, rank=64, tau=tau),
    # full-dimensional anchors, context-free references, exact layer 0 (KVComm's defaults)
    "kvcomm": lambda tau: get_method("kvcomm", anchors=3, tau=tau),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_two_ranks_reproduce_the_single_device_gate_and_correction(engine, steps, name):
    tau = 0.5  # on these caches: some segments accepted, some rejected (checked below)
    single = _serve(engine, steps, METHODS[name](tau), slice(0, 2), None)
    (r0, r1), ex = _sharded(engine, steps, lambda: METHODS[name](tau))
    gates = [d.get("gate") for _, d, _, _ in single]
    assert "accepted" in gates and "rejected" in gates, gates
    assert ex.calls[0] == ex.calls[1] > 0  # the gate and the token weights reduced over both ranks
    for (st, d, k, v), (st0, d0, k0, v0), (st1, d1, k1, v1) in zip(single, r0, r1, strict=True):
        assert st == st0 == st1
        _same_decisions(d0, d1, exact=True)  # one decision on every rank, from the same reduced figures
        _same_decisions(d, d0, exact=False)  # ... and it is the single device's
        # the concatenated heads are the single device's K/V (corrected ones included)
        assert torch.allclose(torch.cat([k0, k1], 1), k, atol=1e-4, rtol=1e-4)
        assert torch.allclose(torch.cat([v0, v1], 1), v, atol=1e-4, rtol=1e-4)
    assert any(st == "corrected" for st, *_ in single)


def test_truncated_anchors_factor_per_rank_and_both_ranks_still_decide_alike(engine, steps):
    """Rank-2 anchors: each rank factors its own heads (not the single device's factorization), so
    the corrections differ from the single device's, but the gate decisions and token weights come
    from the same reduced distances on both ranks."""
    (r0, r1), ex = _sharded(engine, steps, lambda: get_method("kvcmas", anchors=3, rank=2, tau=1.0))
    assert ex.calls[0] == ex.calls[1] > 0
    for (st0, d0, _, _), (st1, d1, _, _) in zip(r0, r1, strict=True):
        assert st0 == st1
        _same_decisions(d0, d1, exact=True)
    assert any(st == "corrected" for st, *_ in r0)


def test_a_nonfinite_correction_on_one_rank_makes_every_rank_fall_back(engine, steps, monkeypatch):
    """Rank 1's corrections turn NaN: both ranks fall back to dense on the same steps (no rank serves
    a corrected segment while the other prefills it), and rank 0's own corrections were finite."""
    from kvcmas_bench.methods.delta import OnlineDeltaCorrection

    local = threading.local()
    real = OnlineDeltaCorrection.weighted_delta

    def poisoned(stack, w, start=0):
        out = real(stack, w, start)
        return out * float("nan") if getattr(local, "rank", 0) == 1 else out

    monkeypatch.setattr(OnlineDeltaCorrection, "weighted_delta", staticmethod(poisoned))

    def rank(r, all_reduce):
        local.rank = r
        m = get_method("kvcmas", anchors=3, rank=64, tau=1.0)
        return _serve(engine, steps, m, slice(r, r + 1), HeadShards(r, 2, 2, all_reduce))

    (r0, r1), _ = on_ranks(2, rank)
    fallbacks = [d.get("fallback") for _, d, _, _ in r0]
    assert "nonfinite" in fallbacks  # the gate accepted and rank 1's NaN reached rank 0's decision
    assert fallbacks == [d.get("fallback") for _, d, _, _ in r1]
    assert [st for st, *_ in r0] == [st for st, *_ in r1] and "corrected" not in [st for st, *_ in r0]
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for _, _, k, v in r0 + r1)


# ---- the worker runtime: one outcome per request over the ranks ------------------------------------
def test_worker_ranks_agree_on_each_plan_and_only_rank_0_answers():
    from kvcmas_bench.methods.base import METHODS as REGISTRY
    from kvcmas_bench.methods.base import Method
    from kvcmas_bench.serving.vllm.worker import WorkerRuntime, agent_params

    @dataclass
    class _Provide(Method):
        """Provides every shared segment (zeros); ``rank1_dense``: rank 1 computes it instead."""

        name = "tp-test-provide"
        rank1_dense: bool = False

        def materialize(self, ctx):
            if self.rank1_dense and ctx.engine.shards.rank == 1:
                return ctx.dense()
            k, v = ctx.engine.empty(ctx.length)
            return SegmentKV(k=k, v=v, start=ctx.start, ids=tuple(ctx.segment.ids), status="reused")

    REGISTRY["tp-test-provide"] = _Provide
    req = Request("A", [Segment("PH", [4, 5, 6, 7], slot="ctx"), Segment("PF", [1, 2, 3])], 2, node="A")

    def rank(r, all_reduce):
        facts = ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", True, HeadShards(r, 2, 2, all_reduce))
        rt = WorkerRuntime(facts, set())
        out = []
        for i, opts in enumerate(({}, {"rank1_dense": True})):
            meta = agent_params(f"s{i}", "tp-test-provide", opts, "t", 0, req, [], f"k{i}", last=True)["kvcmas"]
            rt.new_request(f"r{i}", meta, req.prompt_ids)
            rt.drain()
            plan = rt.plan_of(f"r{i}")
            out.append((rt.take_answers(), plan.prefix_len if plan is not None else None, rt.live[f"r{i}"].error))
        rt.close()
        return out

    try:
        (a0, a1), _ = on_ranks(2, rank)
    finally:
        REGISTRY.pop("tp-test-provide", None)
    # agreed plan: the 4 shared tokens claimed on both ranks; only rank 0 tells the scheduler
    assert a0[0][0] == ({"r0": 4}, {}, {}) and a0[0][1] == 4 and a0[0][2] is None
    assert a1[0][0] == ({}, {}, {}) and a1[0][1] == 4
    # ranks that disagree (rank 1 would compute the segment): both serve it dense, rank 0 says why
    claims, _, errors = a0[1][0]
    assert claims == {"r1": 0} and "disagree" in errors["r1"]
    assert a0[1][1] is None and a1[1][1] is None and "disagree" in a1[1][2]
