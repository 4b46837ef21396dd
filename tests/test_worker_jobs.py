"""The vLLM worker's method thread (no vLLM needed): plans run before other trajectories' background
work, a trajectory's own earlier jobs run before its plan, everything else keeps arrival order, and
tensor-parallel ranks keep one FIFO order."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvcmas_bench.segments import Request, Segment
from kvcmas_bench.serving.vllm.flow import ModelFacts
from kvcmas_bench.serving.vllm.tp import HeadShards
from kvcmas_bench.serving.vllm.worker import Jobs, WorkerRuntime, agent_params, mkl_library


def _order(jobs: Jobs, n: int) -> list[str]:
    return [jobs.get()() for _ in range(n)]


def _queue(jobs: Jobs) -> None:
    jobs.put(lambda: "anchors of A", trajectory="A")
    jobs.put(lambda: "chain B", trajectory="B")
    jobs.put(lambda: "report")
    jobs.put(lambda: "plan C", urgent=True, trajectory="C")
    jobs.put(lambda: "plan B", urgent=True, trajectory="B")
    jobs.put(lambda: "anchors of B", trajectory="B")


def test_plans_first_after_their_own_trajectorys_earlier_jobs():
    jobs = Jobs()
    _queue(jobs)
    # plan C overtakes everything; plan B waits only for "chain B", its trajectory's job queued
    # before it; "anchors of B", queued after plan B, keeps its place among the background jobs
    assert _order(jobs, 6) == ["plan C", "chain B", "plan B", "anchors of A", "report", "anchors of B"]


def test_without_priority_one_fifo():
    jobs = Jobs(prioritize=False)
    _queue(jobs)
    assert _order(jobs, 6) == ["anchors of A", "chain B", "report", "plan C", "plan B", "anchors of B"]


def test_get_blocks_until_a_job_arrives():
    jobs = Jobs()
    got = []
    th = threading.Thread(target=lambda: got.append(jobs.get()))
    th.start()
    th.join(0.2)
    assert th.is_alive() and not got
    jobs.put(None)
    th.join(5)
    assert got == [None]


def _facts(shards=None) -> ModelFacts:
    return ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", True, shards)


def test_a_plan_does_not_wait_behind_another_trajectorys_queued_work():
    """The method thread is busy; another trajectory's slow job is queued; then a request arrives.
    Its plan runs before the queued job, and its record says how long it waited."""
    rt = WorkerRuntime(_facts(), set())
    busy, seen = threading.Event(), []
    rt.submit(busy.wait)
    rt.submit(lambda: seen.append(rt.live["r0"].plan_wait_s), trajectory=("s", "other"))
    req = Request("A", [Segment("PF", [1, 2, 3])], 2, node="A")
    meta = agent_params("s", "nonshared", {}, "t", 0, req, [], "k0", last=True)["kvcmas"]
    rt.new_request("r0", meta, req.prompt_ids)
    busy.set()
    rt.drain()
    assert seen and seen[0] is not None and seen[0] >= 0.0  # planned before the other trajectory's job
    rt.finished("r0", [5, 6])
    rt.drain()
    rec = rt.sessions["s"].reports[-1]
    assert rec["kvcmas_key"] == "k0" and rec["plan_wait_s"] == seen[0]
    rt.close()


def test_tensor_parallel_ranks_keep_arrival_order():
    shards = HeadShards(0, 2, 2, lambda t: t)
    assert WorkerRuntime(_facts(shards), set()).jobs.prioritize is False
    assert WorkerRuntime(_facts(), set()).jobs.prioritize is True


def test_method_work_is_timed_by_kind_of_job():
    """A queued 50 ms anchor-update job, a request's plan and its finish: each kind's busy seconds
    are recorded apart, and together they stay within the thread's total."""
    rt = WorkerRuntime(_facts(), set())
    rt.submit(lambda: time.sleep(0.05), kind="first_token")
    req = Request("A", [Segment("PF", [1, 2, 3])], 2, node="A")
    meta = agent_params("s", "nonshared", {}, "t", 0, req, [], "k0", last=True)["kvcmas"]
    rt.new_request("r0", meta, req.prompt_ids)
    rt.finished("r0", [5, 6])
    rt.drain()
    kinds = dict(rt.busy_by_kind)
    named = {"first_token", "plan", "finish"}
    assert named <= set(kinds) <= named | {"other"}  # drain's own job is "other" (maybe not counted yet)
    assert 0.05 <= kinds["first_token"] < 1.0
    assert kinds["plan"] > 0.0 and kinds["finish"] > 0.0
    assert sum(kinds[k] for k in named) <= rt.busy_s + 1e-6  # each was added to the total after it ran
    rt.close()


def test_method_thread_cpu_seconds_leave_out_waiting():
    """A job that sleeps 0.1 s is busy that long but uses almost no CPU; a job that spins until its
    own thread has used 0.05 s of CPU is recorded with at least that, and never above its wall time."""
    rt = WorkerRuntime(_facts(), set())

    def spin() -> None:
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.05:
            pass

    rt.submit(lambda: time.sleep(0.1), kind="first_token")
    rt.submit(spin, kind="plan")
    rt.drain()
    assert rt.busy_by_kind["first_token"] >= 0.1 and rt.cpu_by_kind["first_token"] < 0.05
    assert 0.05 <= rt.cpu_by_kind["plan"] <= rt.busy_by_kind["plan"] + 1e-3
    rt.close()


@pytest.mark.skipif(mkl_library() is None, reason="torch built without MKL's per-thread controls")
def test_method_thread_limits_mkl_to_one_thread_of_its_own():
    """The method thread runs MKL on one thread (its LAPACK on a second thread with the process's
    thread count is ~10x slower, see limit_blas_threads); the starting thread's MKL and torch thread
    counts stay as they were."""
    lib = mkl_library()
    mkl_before, torch_before = lib.MKL_Get_Max_Threads(), torch.get_num_threads()
    rt = WorkerRuntime(_facts(), set())
    seen = []
    rt.submit(lambda: seen.append(lib.MKL_Get_Max_Threads()))
    rt.drain()
    assert rt.blas_threads == 1 and seen == [1]
    assert lib.MKL_Get_Max_Threads() == mkl_before and torch.get_num_threads() == torch_before
    rt.close()
