"""Event-driven FCFS queue over measured service times (virtual clock, nothing sleeps).

The server modelled here runs **one request at a time** (no batching): a request occupies it for
its whole measured service time (prefill incl. any correction/reference work, then decode). Every
request is measured once in isolation by the in-process engine; this module replays those
service times under an arrival pattern (:func:`replay` is how that engine produces the served
timelines every engine returns):

- trajectory ``t``'s first agent arrives at its start time (``arrivals[t]``), or, for single-stream
  execution (``arrivals is None``, qps 0), when trajectory ``t - 1`` has completed;
- agent ``j > 0`` of a trajectory arrives when agent ``j - 1`` of the same trajectory completes
  (its input contains the predecessor's output);
- the server takes waiting requests first come, first served (ties: earlier trajectory, then
  earlier agent) and never idles while one waits;
- ``start = max(arrival, server free)``, ``first token = start + measured TTFT``,
  ``completion = start + measured E2E``; TTFT under load = first token - arrival.

A batching backend (e.g. vLLM) would overlap requests; its numbers are not comparable with this
server's and must be produced by a different queue model or measured under real load.

Where the waiting goes (:func:`wait_behind`): on this server a waiting request's queueing delay is
covered, second by second, by the service of the requests served before it, so it can be split by
what those requests were (e.g. the share spent behind requests whose service included a dense
prefill of a reuse-eligible shared segment).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..results.request import RequestRecord

SERVER_MODEL = (
    "one request at a time, FCFS, over service times measured in isolation "
    "(no batching); agent j+1 of a trajectory arrives when agent j completes"
)


@dataclass
class Served:
    """One request's timeline on the virtual clock (seconds)."""

    trajectory: int
    agent_index: int
    arrival_s: float
    start_s: float
    first_token_s: float
    completion_s: float

    @property
    def queue_s(self) -> float:
        return self.start_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.completion_s - self.arrival_s


def simulate(service: Sequence[Sequence[tuple[float, float]]], arrivals: Sequence[float] | None) -> list[Served]:
    """Replay ``service[t][j] = (ttft_s, e2e_s)`` of agent ``j`` of trajectory ``t`` on one FCFS server.

    ``arrivals[t]`` is trajectory ``t``'s start time; ``None`` means single stream (each trajectory
    starts when the previous one has completed). Returns the served requests in service order.
    """
    n = len(service)
    if arrivals is not None and len(arrivals) != n:
        raise ValueError(f"{len(arrivals)} arrival times for {n} trajectories")
    for t, traj in enumerate(service):
        if not traj:
            raise ValueError(f"trajectory {t} has no requests")
        for j, (ttft, e2e) in enumerate(traj):
            if not (0 <= ttft <= e2e):
                raise ValueError(f"request {t}/{j}: need 0 <= ttft ({ttft}) <= e2e ({e2e})")
    heap: list[tuple[float, int, int]] = []
    if arrivals is None:
        if n:
            heap.append((0.0, 0, 0))
    else:
        heap = [(float(a), t, 0) for t, a in enumerate(arrivals)]
        heapq.heapify(heap)
    free = 0.0
    out: list[Served] = []
    # Correct FCFS: every request arriving before ``free`` is already in the heap, because it is a
    # trajectory start (all pushed up front) or the successor of a request served before.
    while heap:
        arrival, t, j = heapq.heappop(heap)
        ttft, e2e = service[t][j]
        start = max(arrival, free)
        done = start + e2e
        out.append(Served(t, j, arrival, start, start + ttft, done))
        free = done
        if j + 1 < len(service[t]):
            heapq.heappush(heap, (done, t, j + 1))
        elif arrivals is None and t + 1 < n:
            heapq.heappush(heap, (done, t + 1, 0))
    return out


def replay(
    service: Sequence[Sequence[RequestRecord]], arrivals: Sequence[float] | None, qps: float
) -> list[RequestRecord]:
    """Served timelines of isolated measurements ``service[t][j]`` under ``arrivals`` (see
    :func:`simulate`): each record copied with its timeline, TTFT/E2E under load, and the
    measured service TTFT/E2E kept beside them."""
    served = simulate([[(r.ttft_s, r.e2e_s) for r in tr] for tr in service], arrivals)
    out = []
    for s in served:
        r = service[s.trajectory][s.agent_index]
        out.append(
            replace(
                r,
                qps=qps,
                arrival_s=s.arrival_s,
                start_s=s.start_s,
                first_token_s=s.first_token_s,
                completion_s=s.completion_s,
                queue_s=s.queue_s,
                ttft_s=s.ttft_s,
                e2e_s=s.e2e_s,
                service_ttft_s=r.ttft_s,
                service_e2e_s=r.e2e_s,
            )
        )
    return out


def wait_behind(timelines: Sequence[tuple[float, float, float, bool]]) -> list[float]:
    """Per request ``(arrival_s, start_s, completion_s, flagged)`` of one served timeline on this
    server: the seconds of its queueing delay (arrival to start) during which the server was serving
    a *flagged* request. On a one-request-at-a-time FCFS server the busy intervals
    ``[start, completion]`` never overlap and cover every wait, so the flagged and unflagged parts
    add up to ``start - arrival`` (the result is clipped to it)."""
    busy = sorted((s, c) for _, s, c, f in timelines if f and c > s)
    starts = [s for s, _ in busy]
    ends = [c for _, c in busy]
    prefix = [0.0]
    for s, c in busy:
        prefix.append(prefix[-1] + (c - s))
    out = []
    for a, s, _, _ in timelines:
        if s <= a or not busy:
            out.append(0.0)
            continue
        i0 = bisect.bisect_right(ends, a)  # first flagged interval ending after the arrival
        i1 = bisect.bisect_left(starts, s)  # intervals starting before the start: [i0, i1)
        if i1 <= i0:
            out.append(0.0)
            continue
        got = prefix[i1] - prefix[i0] - max(0.0, a - starts[i0]) - max(0.0, ends[i1 - 1] - s)
        out.append(min(max(got, 0.0), s - a))
    return out
