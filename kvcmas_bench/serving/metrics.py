"""Metrics of a serve-sweep: one function from served timelines to a summary row.

Every engine returns :class:`~kvcmas_bench.results.RequestRecord` rows with their timeline
(arrival, start, first token, completion) and, where measured in isolation, their service TTFT/E2E;
:func:`sweep_row` turns one (method, shared length, QPS) group of them into the row of
``summary.json`` and of the console table, in the manner of ``vllm bench serve``'s metrics.
:func:`ttft_breakdown` is the one definition of where a request's TTFT goes (own service vs
queueing, and the queueing spent behind dense fallbacks): the sweep rows, the console tables and the
plots all read its columns. Percentiles are the project's one definition,
:func:`kvcmas_bench.results.stats.percentile`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..results import figures
from ..results.request import RequestRecord
from ..results.stats import percentile_rank
from ..results.summary import flat_frame
from .queueing import wait_behind

QPS_UNIT = "trajectory starts per second (each trajectory = 4 dependent agent requests)"
DEFINITIONS = {
    "ttft_pXX_s": "numpy.percentile (linear) over all agent requests of first-token time - arrival, under load",
    "e2e_pXX_s": "completion - arrival, under load",
    "service_ttft_mean_s / service_e2e_mean_s": "measured in isolation (engine ttft_s / e2e_s; TTFT includes "
    "correction and reference-prefill work)",
    "trajectory_service_mean_s": "sum of the 4 agents' measured E2E, mean over trajectories",
    "utilization": "offered load = qps x trajectory_service_mean_s (None for single stream, and for engines that "
    "serve for real without isolated service times); >= 1 saturates",
    "trajectory_latency_mean_s": "last agent's completion - first agent's arrival, mean over trajectories",
    "utilization (served for real)": "engines without isolated service times (vLLM): qps x the mean trajectory "
    "latency of the QPS 0 (single stream) point of the same method and shared length, i.e. the in-process "
    "definition with the single stream as service time; a batching server's capacity is at least the "
    "single-stream rate, so < 1 is sustainable (it may sustain more)",
    "latency_inflation": "trajectory_latency_mean_s / the same at QPS 0 (informational)",
    "drain_ratio": "(last - first trajectory completion) / (last - first trajectory arrival); judges saturation "
    "(> 1.25) only for engines without service times when no single-stream point was served",
    "busy_fraction": "total service time / makespan",
    "makespan_s": "last completion - first arrival on the virtual clock",
    "throughput_req_s / throughput_tok_s": "agent requests / generated tokens per second of makespan",
    "peak_mem_bytes": "max over requests of the device peak (CUDA) or process peak RSS; the peak is reset "
    "before each method's measured trajectories where the OS allows (see backend_config)",
    "kv_state_peak_bytes": "max over requests of request KV + the trajectory's shared-segment store + "
    "method.state_bytes() (anchor pools, references, calibration tables)",
    "reuse_ratio": "kvcmas_bench.results.summary.reuse_ratio over the measured requests (the realized rho)",
    "rho_target": "with --matched-rho: the rho the method was set to (the schedule's rho for FullShared, GraphFlow, "
    "KVComm and KVCMAS; the rho knob for CacheBlend, DroidSpeak and RelayCaching); None otherwise",
    "ttft_{p50,p90,mean}_{part}_s": "TTFT under load split into parts that add up to it: per request TTFT = queue "
    "(arrival to start) + service (start to first token; in-process: the TTFT measured in isolation); service = "
    "service_shared_dense (materialization time of shared segments prefilled densely, incl. the gate's time before "
    "a fallback) + service_shared_reuse (of reused/corrected/recomputed ones: gate, context-free reference, "
    "correction, recomputation) + service_other (private segments' prefill, the first token, engine overhead); "
    "queue = queue_dense + queue_other. pXX: the parts of the request(s) at the pXX rank of TTFT, with numpy's "
    "linear-interpolation weights, so they add up to ttft_pXX_s",
    "queue_dense": "the seconds of a request's wait during which the one-request-at-a-time server was serving "
    "requests whose service included a dense prefill of a reuse-eligible shared segment (a dense fallback: "
    "scheduled, gated or, for NonShared, every one); this and the service_* parts are None for engines that serve "
    "for real (batching: requests overlap, and method planning precedes submission)",
    "queue_dense_share": "sum of queue_dense / sum of queue over the point's requests (None without queueing)",
    "dense_fallback_share": "share of the point's requests whose service prefilled a reuse-eligible shared "
    "segment densely",
    "deferred_mean_s / decode_mean_s": "after the first token (not in TTFT, but occupying the server): anchor "
    "construction (deferred_s) and the rest of completion - first token",
}

#: the parts of a request's TTFT under load (see DEFINITIONS): queue + service = TTFT
TTFT_PARTS, TTFT_PART_STATS = figures.TTFT_PARTS, figures.TTFT_PART_STATS


_mean = figures.mean_of


def served_metrics(served: Sequence[RequestRecord], qps: float) -> dict:
    """TTFT/E2E percentiles under load, throughput over the makespan, offered load."""
    by_traj: dict[str, list[RequestRecord]] = {}
    for r in served:
        by_traj.setdefault(r.trajectory, []).append(r)
    makespan = max(r.completion_s for r in served) - min(r.arrival_s for r in served)
    service = [r.service_e2e_s for r in served]
    traj_service = [sum(r.service_e2e_s for r in rs) for rs in by_traj.values()] if None not in service else []
    row: dict = {"n_trajectories": len(by_traj), "n_requests": len(served)}
    row["queue_mean_s"] = _mean([r.queue_s for r in served])
    row["service_ttft_mean_s"] = _mean([r.service_ttft_s for r in served])
    row["service_e2e_mean_s"] = _mean(service)
    row["trajectory_latency_mean_s"] = float(
        np.mean([max(r.completion_s for r in rs) - min(r.arrival_s for r in rs) for rs in by_traj.values()])
    )
    row["trajectory_service_mean_s"] = float(np.mean(traj_service)) if traj_service else None
    row["makespan_s"] = makespan
    row["throughput_req_s"] = len(served) / makespan if makespan > 0 else None
    row["throughput_tok_s"] = sum(r.output_tokens for r in served) / makespan if makespan > 0 else None
    row["busy_fraction"] = sum(traj_service) / makespan if makespan > 0 and traj_service else None
    # offered load of the open-loop arrivals; single stream (qps 0) has none
    mean_traj = row["trajectory_service_mean_s"]
    row["utilization"] = qps * mean_traj if qps > 0 and mean_traj is not None else None
    row["drain_ratio"] = drain_ratio(by_traj.values()) if qps > 0 else None
    if row["utilization"] is not None:
        row["saturated"] = bool(row["utilization"] >= 1.0)
    else:
        row["saturated"] = bool(row["drain_ratio"] is not None and row["drain_ratio"] > DRAIN_LIMIT)
    return row


#: a served-for-real point whose trajectories complete this much more spread out than they arrive
DRAIN_LIMIT = 1.25


def mark_saturation(rows: Sequence[dict]) -> None:
    """Utilization of rows served for real (no isolated service times): qps x the single-stream
    trajectory latency of the same method and shared length, when the QPS 0 point was served
    (saturated at >= 1, as in-process); without it the drain-ratio rule of :func:`served_metrics`
    stands."""
    single = {(r["method"], r["shared_tokens"]): r for r in rows if r["qps"] == 0}
    for r in rows:
        if r.get("utilization") is not None or r["qps"] <= 0:
            continue
        ref = single.get((r["method"], r["shared_tokens"]))
        if ref is not None and ref.get("trajectory_latency_mean_s"):
            r["utilization"] = r["qps"] * ref["trajectory_latency_mean_s"]
            r["utilization_basis"] = "single-stream trajectory latency"
            r["latency_inflation"] = r["trajectory_latency_mean_s"] / ref["trajectory_latency_mean_s"]
            r["saturated"] = bool(r["utilization"] >= 1.0)


def drain_ratio(trajectories) -> float | None:
    """Completion span / arrival span of the trajectories (None for fewer than two)."""
    spans = [(min(r.arrival_s for r in rs), max(r.completion_s for r in rs)) for rs in trajectories if rs]
    if len(spans) < 2:
        return None
    arr = max(a for a, _ in spans) - min(a for a, _ in spans)
    done = max(c for _, c in spans) - min(c for _, c in spans)
    return done / arr if arr > 0 else None


def load_metrics(requests: Sequence[RequestRecord]) -> dict:
    """The figures of one point computed from its request records (:mod:`kvcmas_bench.results.figures`,
    scope ``sweep``: TTFT/E2E percentiles, memory, tokens, reuse) and the kind of peak measured."""
    return {
        **figures.evaluate(pd.DataFrame(), flat_frame(list(requests)), "sweep"),
        "peak_mem_kind": "device" if requests and requests[0].device_peak_bytes is not None else "rss",
    }


def dense_fallback(r: RequestRecord) -> bool:
    """Whether the request's service prefilled a reuse-eligible shared segment densely."""
    return any(s.kind == "PH" and s.eligible and s.status == "exact" for s in r.segments)


def reuse_work_s(r: RequestRecord) -> float:
    """The wall time of materializing the request's shared segments served from a reused cache
    (gate, correction, alignment); dense segments are left out (in-process their time is the
    prefill itself)."""
    return sum(s.materialize_s or 0.0 for s in r.segments if s.kind == "PH" and s.status != "exact")


def request_parts(served: Sequence[RequestRecord]) -> list[dict]:
    """Per request of one served timeline: its TTFT and the parts of :data:`TTFT_PARTS` (seconds).
    Only queue and service unless every request has an isolated service time (replayed on the
    one-request-at-a-time server, where waits can be attributed and the service is the measured
    one); the finer parts are None otherwise."""
    replayed = bool(served) and all(r.service_e2e_s is not None for r in served)
    behind = (
        wait_behind([(r.arrival_s, r.start_s, r.completion_s, dense_fallback(r)) for r in served])
        if replayed
        else [None] * len(served)
    )
    out = []
    for r, qd in zip(served, behind):
        queue = float(r.queue_s or 0.0)
        service = float(r.service_ttft_s) if r.service_ttft_s is not None else float(r.ttft_s) - queue
        part = {
            "ttft": queue + service,
            "queue": queue,
            "queue_dense": qd,
            "queue_other": None if qd is None else queue - qd,
            "service": service,
            "service_shared_dense": None,
            "service_shared_reuse": None,
            "service_other": None,
        }
        if replayed:  # served for real, the method's work (planning) precedes submission: not split
            dense = sum(s.materialize_s or 0.0 for s in r.segments if s.kind == "PH" and s.status == "exact")
            reuse = reuse_work_s(r)
            part.update(service_shared_dense=dense, service_shared_reuse=reuse, service_other=service - dense - reuse)
        out.append(part)
    return out


def _at_rank(parts: list[dict], q: float) -> dict:
    """The parts at the ``q`` percentile of TTFT: the linear interpolation of
    :func:`~kvcmas_bench.results.stats.percentile_rank` between the two requests around that rank,
    applied to every part (so they add up to the percentile)."""
    order = sorted(range(len(parts)), key=lambda i: parts[i]["ttft"])
    lo, hi, f = percentile_rank(len(order), q)
    a, b = parts[order[lo]], parts[order[hi]]
    return {k: None if a[k] is None or b[k] is None else a[k] + f * (b[k] - a[k]) for k in TTFT_PARTS}


def ttft_breakdown(served: Sequence[RequestRecord]) -> dict:
    """Where the TTFT of one (method, shared length, QPS) point goes: the row columns
    ``ttft_{p50,p90,mean}_{part}_s`` (:data:`TTFT_PARTS`), ``queue_dense_share``,
    ``dense_fallback_share`` and the post-first-token occupancy (see :data:`DEFINITIONS`)."""
    parts = request_parts(served)
    row: dict = {}
    if not parts:
        return row
    for stat in TTFT_PART_STATS:
        if stat == "mean":
            vals = {
                k: _mean([p[k] for p in parts]) if all(p[k] is not None for p in parts) else None for k in TTFT_PARTS
            }
        else:
            vals = _at_rank(parts, float(stat[1:]))
        row.update({f"ttft_{stat}_{k}_s": v for k, v in vals.items()})
    queued = sum(p["queue"] for p in parts)
    dense_q = [p["queue_dense"] for p in parts]
    row["queue_dense_share"] = sum(dense_q) / queued if queued > 0 and None not in dense_q else None
    row["dense_fallback_share"] = sum(dense_fallback(r) for r in served) / len(served)
    row["deferred_mean_s"] = _mean([r.deferred_s or 0.0 for r in served])
    row["decode_mean_s"] = _mean([r.e2e_s - r.ttft_s - (r.deferred_s or 0.0) for r in served])
    return row


def sweep_row(method: str, shared: int, qps: float, served: Sequence[RequestRecord]) -> dict:
    """The summary row of one (method, shared length, QPS) point."""
    return {
        "method": method,
        "shared_tokens": shared,
        "qps": qps,
        **served_metrics(served, qps),
        **load_metrics(served),
        **ttft_breakdown(served),
    }


def sweep_rows(served: Sequence[RequestRecord]) -> list[dict]:
    """The rows of a sweep from its served requests (each carrying its ``method``,
    ``shared_tokens`` and ``qps``): one :func:`sweep_row` per point in the order first met,
    saturation marked. ``serve-sweep`` writes its summary with it and the readers recompute the
    rows with it from ``requests.jsonl``."""
    groups: dict[tuple, list[RequestRecord]] = {}
    for r in served:
        groups.setdefault((r.method, r.shared_tokens, r.qps), []).append(r)
    rows = [sweep_row(m, s, q, rs) for (m, s, q), rs in groups.items()]
    mark_saturation(rows)
    return rows


def capacity(rows: Sequence[dict], reference: str = "nonshared") -> dict:
    """Per shared length: the QPS the reference method (NonShared) can sustain.

    ``nonshared_capacity_qps`` = 1 / its mean trajectory service time (the rate at which the
    utilization reaches 1 on a one-request-at-a-time server); ``nonshared_max_stable_qps``: the
    highest swept QPS > 0 at which it stayed below saturation (None when none did).
    """
    out: dict = {}
    for r in rows:
        if r["method"] != reference:
            continue
        c = out.setdefault(r["shared_tokens"], {"nonshared_capacity_qps": None, "nonshared_max_stable_qps": None})
        if r.get("trajectory_service_mean_s"):
            c["nonshared_capacity_qps"] = 1.0 / r["trajectory_service_mean_s"]
        elif r["qps"] == 0 and r.get("trajectory_latency_mean_s"):  # served for real: the single stream
            c["nonshared_capacity_qps"] = 1.0 / r["trajectory_latency_mean_s"]
        if r["qps"] > 0 and not r.get("saturated"):
            c["nonshared_max_stable_qps"] = max(r["qps"], c["nonshared_max_stable_qps"] or 0.0)
    return out
