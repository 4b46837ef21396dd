"""Aggregate per-sample and per-request records into a run summary (pandas).

Every figure is computed from the records, so a report can recompute any other definition from
``requests.jsonl``; ``DEFINITIONS`` (written into ``summary.json``) states the ones used here.

:func:`run_figures` is the one definition of a run's figures (accuracy with its standard error and
interval, latency, TTFT mean/p50/p90, E2E, memory, method state, rho, KV error, top-1 agreement,
first-token KL): ``summary.json`` (:func:`summarize`) and the report's Table 1
(:func:`kvcmas_bench.report.tables.run_metrics`) both take them from it, under the same names.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pandas as pd

from . import figures
from .request import RequestRecord, request_row
from .stats import percentile

#: what summary.json's figures mean: each figure's own definition (:mod:`.figures`), and the sections
DEFINITIONS = {
    **figures.definitions("run"),
    "fidelity.per_agent": "the same per workflow node, in execution order",
    "fidelity.per_layer": "per-layer relative error, averaged over every shared segment",
    "fidelity.by_status": "mean relative error of the segments with each materialization status",
    "accounting": "sums over requests of the methods' counters (accepted corrections, dense and non-finite "
    "fallbacks, anchors inserted/evicted, uncalibrated relations) and segment statuses; gate entropy, "
    "comparison-prefix and anchors-used distributions over the gate decisions",
}
#: the figures of :func:`run_figures` that ``summary.json`` keeps under ``fidelity``
FIDELITY_FIGURES = ("kv_rel_error", "top1_agree", "first_token_kl")
FIDELITY_KEYS = tuple(k for f in FIDELITY_FIGURES for k in figures.FIGURES[f].keys())


_mean = figures.mean_of


def records_frame(requests: list[RequestRecord]) -> pd.DataFrame:
    """One row per request record, every declared field a column (segments as lists of dicts)."""
    return pd.DataFrame([asdict(r) for r in requests])


def flat_frame(requests: list[RequestRecord]) -> pd.DataFrame:
    """The request records as the flat rows :func:`run_figures` reads (``request.request_row``)."""
    return pd.DataFrame([request_row(r) for r in requests])


def run_figures(samples: pd.DataFrame, requests: pd.DataFrame) -> dict:
    """Every figure of one run from its sample rows and flat request rows (``request.request_row``):
    the one definition behind ``summary.json``, Table 1 and the exported frames (:mod:`.figures`)."""
    out: dict = {"n": len(samples)}
    if samples.empty:
        return out
    return {**out, **figures.evaluate(samples, requests, "run")}


def fidelity_figures(r: pd.DataFrame) -> dict:
    """KV error, top-1 agreement with its SE and interval, first-token KL, from flat request rows."""
    return {k: v for f in FIDELITY_FIGURES for k, v in figures.FIGURES[f].evaluate(pd.DataFrame(), r).items()}


def summarize(samples: list[dict], requests: list[RequestRecord], meta: dict) -> dict:
    """Accuracy, latency, TTFT, memory, reuse ratio, fidelity and method accounting of a run."""
    s = pd.DataFrame(samples)
    figs = run_figures(s, flat_frame(requests))
    out = {**meta, **{k: v for k, v in figs.items() if k not in FIDELITY_KEYS}}
    if s.empty or not requests:
        return out
    r = records_frame(requests)
    out["per_agent"] = per_node(requests)
    out["per_slot"] = per_slot_reuse(r)
    fid = fidelity(requests)
    if fid:
        out["fidelity"] = fid
    out["accounting"] = accounting(requests)
    warning = starved_warning(out["accounting"])
    if warning:
        out["warnings"] = [warning]
    out["definitions"] = DEFINITIONS
    return out


#: gate outcomes that more data removes: the pools were still filling
STARVED = ("no_anchor", "too_few_anchors")


def starved_warning(acc: dict) -> str | None:
    """One line when at least half of the gated segments fell back densely because the online
    pools held too few anchors yet (a short run, no warm-up): its figures measure little of the
    method. None otherwise (and for methods without a gate)."""
    gate = acc.get("gate") or {}
    total = sum(v for v in gate.values() if isinstance(v, int))
    starved = sum(gate.get(k, 0) for k in STARVED)
    if not total or 2 * starved < total:
        return None
    parts = ", ".join(f"{k} {gate[k]}" for k in STARVED if gate.get(k))
    return (
        f"{starved} of {total} gated segments fell back densely because the anchor pools were still filling "
        f"({parts}): these figures measure little of the method; add --warmup N (held-out samples fill the "
        "pools first, in no figure) or raise --limit"
    )


reuse_ratio = figures.reuse_ratio


def per_slot_reuse(r: pd.DataFrame) -> dict:
    """rho per shared slot, from the per-segment records of the requests."""
    rows = [
        {
            "slot": s["slot"],
            "tokens": s["tokens"],
            "reused_tokens": s.get("reused_tokens", 0),
            "recomputed_token_layers": s.get("recomputed_token_layers", 0),
            "layers": layers,
        }
        for segs, layers in zip(r["segments"], r["layers"])
        for s in segs
        if s.get("kind") == "PH" and s.get("eligible")
    ]
    if not rows:
        return {}
    df = pd.DataFrame(rows)
    return {slot: reuse_ratio(g) for slot, g in df.groupby("slot", sort=False)}


def _by_step(requests: list[RequestRecord]) -> dict[int, list[RequestRecord]]:
    groups: dict[int, list[RequestRecord]] = {}
    for rec in requests:
        groups.setdefault(rec.step if rec.step is not None else -1, []).append(rec)
    return dict(sorted(groups.items()))


def per_node(requests: list[RequestRecord]) -> list[dict]:
    """TTFT, E2E, rho and (when measured) fidelity per workflow node, in execution order."""
    out = []
    for step, recs in _by_step(requests).items():
        figs = figures.evaluate(pd.DataFrame(), flat_frame(recs), "run")
        row = {"step": step, "node": recs[0].node, "agent": recs[0].agent}
        row.update({k: figs.get(k) for k in ("ttft_mean_s", "e2e_mean_s", "reuse_ratio")})
        if figs.get("kv_rel_error") is not None:
            row["kv_rel_error"] = figs["kv_rel_error"]
        if any(r.top1_agree is not None for r in recs):
            row.update(top1_agree=figs["top1_agree"], first_token_kl=figs["first_token_kl"])
        out.append(row)
    return out


def fidelity(requests: list[RequestRecord]) -> dict:
    """KV error over every shared segment (overall, per node, per layer, per status) and the
    first-token agreement/KL, when the run measured them; {} otherwise."""
    segs = [s for r in requests for s in r.shared_segments if s.kv_rel_error is not None]
    measured = [r for r in requests if r.top1_agree is not None]
    if not segs and not measured:
        return {}
    layers = [s.kv_rel_error_per_layer for s in segs if s.kv_rel_error_per_layer]
    statuses = sorted({s.status for s in segs})
    return {
        **fidelity_figures(flat_frame(requests)),
        "segments": len(segs),
        "per_agent": [
            {k: row[k] for k in ("step", "node", "agent", "kv_rel_error", "top1_agree", "first_token_kl") if k in row}
            for row in per_node(requests)
        ],
        "per_layer": [float(x) for x in np.mean(np.asarray(layers, dtype=float), axis=0)] if layers else [],
        "by_status": {st: _mean(s.kv_rel_error for s in segs if s.status == st) for st in statuses},
    }


def _distribution(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values, dtype=float)
    return {
        "n": len(values),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "p10": percentile(a, 10),
        "p50": percentile(a, 50),
        "p90": percentile(a, 90),
        "max": float(a.max()),
    }


def accounting(requests: list[RequestRecord]) -> dict:
    """Method counters summed over requests, segment statuses, and the gate's distributions."""
    counters: dict[str, int] = {}
    for r in requests:
        for k, v in r.method_stats.items():
            counters[k] = counters.get(k, 0) + int(v)
    shared = [s for r in requests for s in r.shared_segments]
    statuses: dict[str, int] = {}
    for s in shared:
        statuses[s.status] = statuses.get(s.status, 0) + 1
    details = [s.details for s in shared if s.details]
    gates: dict[str, int] = {}  # outcome value -> segments, in order of first appearance
    for s in shared:
        if s.gate is not None:
            gates[s.gate.value] = gates.get(s.gate.value, 0) + 1
    out: dict = {**counters, "segments": statuses}
    if gates:
        out["gate"] = gates
        out["gate_entropy"] = _distribution([d["entropy"] for d in details if "entropy" in d])
        out["compare_tokens"] = _distribution([d["compare_tokens"] for d in details if "compare_tokens" in d])
        out["anchors_used"] = _distribution([d["anchors_used"] for d in details if "anchors_used" in d])
    return out
