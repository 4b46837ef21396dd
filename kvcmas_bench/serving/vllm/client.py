"""Real-time trace replay on a batching engine: requests arrive on the wall clock, run concurrently,
and TTFT is taken at the first streamed token.

The client drives an engine that exposes a step loop (``submit``, ``step`` -> events, ``busy``;
:class:`~.inprocess.VLLMEngine` wraps vLLM's in-process ``LLMEngine``, whose ``step()`` runs one
continuous-batching iteration over every running request and streams each request's new tokens):

- trajectory ``t`` arrives at ``arrivals[t]`` seconds after the schedule starts (Poisson/gamma
  gaps from :func:`~kvcmas_bench.serving.arrivals.arrival_times`), or, single stream
  (``arrivals is None``), when trajectory ``t - 1`` has finished;
- agent ``j + 1`` of a trajectory arrives when agent ``j`` finishes (its prompt holds that output);
- an arrived agent is planned by its method (:mod:`.flow`), possibly after prefill-only requests
  for context-free references, then submitted; everything in flight is batched by the engine;
- ``arrival_s`` is the scheduled arrival, ``start_s`` the submission to the engine (after planning),
  ``first_token_s`` the end of the engine step that streamed the request's first token (what a
  streaming client sees, as ``vllm bench serve`` measures it), ``completion_s`` the step that
  finished it; TTFT = first_token_s - arrival_s, E2E = completion_s - arrival_s.

An engine step cannot be interrupted, so a request arriving during one is submitted after it (its
wait counts in its TTFT, as it would on a server); planning and deferred method work run between
steps, in this process, and delay the engine like any server-side work would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...results.request import RequestRecord
from ...segments import SegmentKV
from .flow import EngineRequest, NeedKV, Runtime, TrajectoryRun, kv_request


@dataclass
class Event:
    """What one engine step reports for one request."""

    key: str
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    #: tokens whose K/V the engine did not compute (connector claim / prefix-cache hit)
    cached_tokens: int | None = None
    #: top logprobs of the first streamed token, when asked for
    first_logprobs: dict | None = None


class StepEngine(Protocol):
    def submit(self, request: EngineRequest) -> None: ...

    def step(self) -> list[Event]: ...

    def busy(self) -> bool: ...


@dataclass
class _Flight:
    request: EngineRequest
    run: TrajectoryRun | None = None
    ids: tuple[int, ...] = ()
    capture: object = None
    tokens: list[int] = field(default_factory=list)
    first: bool = False
    cached: int | None = None


class Client:
    """Serves trajectory runs on ``engine`` under an arrival schedule (see the module docstring)."""

    def __init__(
        self,
        engine: StepEngine,
        rt: Runtime,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        forget: Callable[[str], None] | None = None,
    ):
        self.engine, self.rt, self.clock, self.sleep = engine, rt, clock, sleep
        self.forget = forget or (lambda key: None)
        self.flights: dict[str, _Flight] = {}
        self.waiting: dict[tuple[int, ...], list[TrajectoryRun]] = {}
        self.ready: list[TrajectoryRun] = []
        #: wall time (schedule clock) at which each trajectory's first agent was planned (tests)
        self.released: dict[str, float] = {}

    def serve(self, runs: Sequence[TrajectoryRun], arrivals: Sequence[float] | None) -> list[RequestRecord]:
        """Serve every run; returns their records in completion order."""
        if arrivals is not None and len(arrivals) != len(runs):
            raise ValueError(f"{len(arrivals)} arrival times for {len(runs)} trajectories")
        order = sorted(range(len(runs)), key=lambda i: arrivals[i]) if arrivals is not None else list(range(len(runs)))
        t0 = self.clock()
        now = lambda: self.clock() - t0  # noqa: E731
        nxt = 0
        out: list[RequestRecord] = []
        active = 0
        while True:
            t = now()
            if arrivals is not None:
                while nxt < len(order) and arrivals[order[nxt]] <= t:
                    self._arrive(runs[order[nxt]], float(arrivals[order[nxt]]))
                    nxt += 1
                    active += 1
            elif active == 0 and nxt < len(order):
                self._arrive(runs[order[nxt]], t)
                nxt += 1
                active += 1
            self._plan_ready(now)
            if self.engine.busy():
                for ev in self.engine.step():
                    done = self._event(ev, now(), out)
                    active -= done
            elif arrivals is not None and nxt < len(order):
                self.sleep(max(0.0, min(arrivals[order[nxt]] - now(), 0.05)))
            elif not self.ready and active == 0:
                return out
            elif not self.ready:
                raise RuntimeError("client stalled: trajectories wait but nothing is in flight")

    def _arrive(self, run: TrajectoryRun, at: float) -> None:
        run.begin(at)
        self.ready.append(run)

    def _plan_ready(self, now: Callable[[], float]) -> None:
        ready, self.ready = self.ready, []
        for run in ready:
            if run.index == 0 and run.trace.id not in self.released:
                self.released[run.trace.id] = now()
            got = run.plan()
            if isinstance(got, NeedKV):
                self._need(run, got.ids)
                continue
            self.flights[got.key] = _Flight(got, run=run)
            self.engine.submit(got)
            run.submitted(now())

    def _need(self, run: TrajectoryRun, ids: tuple[int, ...]) -> None:
        first = ids not in self.waiting
        self.waiting.setdefault(ids, []).append(run)
        if first:
            req, cap = kv_request(self.rt, ids)
            self.flights[req.key] = _Flight(req, ids=ids, capture=cap)
            self.engine.submit(req)

    def _event(self, ev: Event, t: float, out: list[RequestRecord]) -> int:
        """Handle one step event; returns 1 when a trajectory finished."""
        f = self.flights.get(ev.key)
        if f is None:
            return 0
        if ev.cached_tokens is not None:
            f.cached = ev.cached_tokens
        f.tokens.extend(ev.tokens)
        if f.run is not None and ev.tokens and not f.first:
            f.first = True
            f.run.first_token(t, f.tokens[0], ev.first_logprobs)
        if not ev.finished:
            return 0
        del self.flights[ev.key]
        self.forget(ev.key)
        if f.run is None:  # a prefill-only request: its capture unblocks whoever waits for it
            cap = f.capture
            if not cap.complete:
                raise RuntimeError("prefill-only request finished but its K/V was not captured whole")
            for run in self.waiting.pop(f.ids, []):
                self.rt.facts.ready[f.ids] = SegmentKV(k=cap.k, v=cap.v, start=0, ids=f.ids)
                self.ready.append(run)
            return 0
        run = f.run
        out.append(run.finished(t, f.tokens, f.cached))
        if run.done:
            return 1
        run.begin(t)
        self.ready.append(run)
        return 0


def fetch_kv(engine: StepEngine, rt: Runtime, ids: Sequence[int], forget: Callable[[str], None]) -> SegmentKV:
    """Run one prefill-only request to completion (no other traffic) and return its K/V."""
    req, cap = kv_request(rt, tuple(ids))
    engine.submit(req)
    while True:
        for ev in engine.step():
            if ev.key == req.key and ev.finished:
                forget(req.key)
                if not cap.complete:
                    raise RuntimeError("prefill-only request finished but its K/V was not captured whole")
                return SegmentKV(k=cap.k, v=cap.v, start=0, ids=tuple(ids))
        if not engine.busy():
            raise RuntimeError("engine went idle before the prefill-only request finished")
