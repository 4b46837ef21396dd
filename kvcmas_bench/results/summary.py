"""Aggregate per-sample and per-request records into a run summary (pandas).

Every figure is computed from the records, so a report can recompute any other definition from
``requests.jsonl``; ``DEFINITIONS`` (written into ``summary.json``) states the ones used here.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pandas as pd

from .request import RequestRecord

DEFINITIONS = {
    "reuse_ratio": "rho = (shared token, layer) entries served by reuse / entries of reuse-eligible shared "
    "segments. Eligibility is fixed before the method runs, by method family and segment: source-based "
    "methods (nonshared, fullshared, cacheblend, droidspeak, relaycaching, chained kvcmas) count the shared "
    "segments that have a source; context-free-reference methods (kvcomm, kvcmas-nonchained, graphflow) "
    "count every shared segment, the first agent's included. A dense fallback stays in the denominator; "
    "recomputed (token, layer) entries are not served by reuse. Per segment: eligible, reused_tokens, "
    "prefilled_tokens, reference_tokens, recomputed_token_layers in requests.jsonl.",
    "fidelity.kv_rel_error": "||C_method - C_dense||_F / ||C_dense||_F over K and V of one shared segment, "
    "averaged over every shared segment of every request (exactly prefilled segments count as 0)",
    "fidelity.per_agent": "the same per workflow node, in execution order",
    "fidelity.per_layer": "per-layer relative error, averaged over every shared segment",
    "fidelity.by_status": "mean relative error of the segments with each materialization status",
    "accounting": "sums over requests of the methods' counters (accepted corrections, dense and non-finite "
    "fallbacks, anchors inserted/evicted, uncalibrated relations) and segment statuses; gate entropy, "
    "comparison-prefix and anchors-used distributions over the gate decisions",
}


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(vals)) if vals else None


def records_frame(requests: list[RequestRecord]) -> pd.DataFrame:
    """One row per request record, every declared field a column (segments as lists of dicts)."""
    return pd.DataFrame([asdict(r) for r in requests])


def summarize(samples: list[dict], requests: list[RequestRecord], meta: dict) -> dict:
    """Accuracy, latency, TTFT, memory, reuse ratio, fidelity and method accounting of a run."""
    s = pd.DataFrame(samples)
    r = records_frame(requests)
    out = {**meta, "n": len(s)}
    if s.empty:
        return out
    out["accuracy"] = float(s["correct"].mean())
    out["latency_s"] = float(s["latency_s"].mean())
    out["latency_s_p50"] = float(s["latency_s"].median())
    if r.empty:
        return out
    out["ttft_s"] = float(r["ttft_s"].mean())
    out["ttft_s_p50"] = float(r["ttft_s"].median())
    out["ttft_s_p90"] = float(r["ttft_s"].quantile(0.9))
    out["e2e_s"] = float(r["e2e_s"].mean())
    out["peak_mem_bytes"] = int(r["peak_mem_bytes"].max())
    out["peak_rss_bytes"] = int(r["peak_rss_bytes"].max())
    out["kv_state_peak_bytes"] = int(r["kv_state_bytes"].max())
    out["method_state_peak_bytes"] = int(r["method_state_bytes"].max())
    for key in ("prefilled_tokens", "reused_tokens", "eligible_tokens", "reference_tokens", "recomputed_token_layers"):
        out[key] = int(r[key].sum())
    out["reuse_ratio"] = reuse_ratio(r)
    out["per_agent"] = per_node(requests)
    out["per_slot"] = per_slot_reuse(r)
    fid = fidelity(requests)
    if fid:
        out["fidelity"] = fid
    out["accounting"] = accounting(requests)
    out["definitions"] = DEFINITIONS
    return out


def reuse_ratio(r: pd.DataFrame) -> float | None:
    """rho = (token, layer) entries served by reuse / reuse-eligible shared entries."""
    eligible = float((r["eligible_tokens"] * r["layers"]).sum())
    if eligible == 0:
        return None
    served = float((r["reused_tokens"] * r["layers"]).sum() - r["recomputed_token_layers"].sum())
    rho = served / eligible
    return None if math.isnan(rho) else rho


def per_slot_reuse(r: pd.DataFrame) -> dict:
    """rho per shared slot, from the per-segment records of the requests."""
    rows = [
        {
            "slot": s["slot"],
            "tokens": s["tokens"],
            "reused": s.get("reused_tokens", 0),
            "recomputed": s.get("recomputed_token_layers", 0),
            "layers": layers,
        }
        for segs, layers in zip(r["segments"], r["layers"])
        for s in segs
        if s.get("kind") == "PH" and s.get("eligible")
    ]
    if not rows:
        return {}
    df = pd.DataFrame(rows)
    out = {}
    for slot, g in df.groupby("slot", sort=False):
        eligible = float((g["tokens"] * g["layers"]).sum())
        out[slot] = float(((g["reused"] * g["layers"]).sum() - g["recomputed"].sum()) / eligible)
    return out


def _by_step(requests: list[RequestRecord]) -> dict[int, list[RequestRecord]]:
    groups: dict[int, list[RequestRecord]] = {}
    for rec in requests:
        groups.setdefault(rec.step if rec.step is not None else -1, []).append(rec)
    return dict(sorted(groups.items()))


def per_node(requests: list[RequestRecord]) -> list[dict]:
    """TTFT, E2E, rho and (when measured) fidelity per workflow node, in execution order."""
    out = []
    for step, recs in _by_step(requests).items():
        row = {
            "step": step,
            "node": recs[0].node,
            "agent": recs[0].agent,
            "ttft_s": _mean(r.ttft_s for r in recs),
            "e2e_s": _mean(r.e2e_s for r in recs),
            "reuse_ratio": reuse_ratio(records_frame(recs)),
        }
        errs = [s.kv_rel_error for r in recs for s in r.shared_segments if s.kv_rel_error is not None]
        if errs:
            row["kv_rel_error"] = _mean(errs)
        if any(r.top1_agree is not None for r in recs):
            row["top1_agree"] = _mean(float(r.top1_agree) for r in recs if r.top1_agree is not None)
            row["first_token_kl"] = _mean(r.first_token_kl for r in recs)
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
        "kv_rel_error": _mean(s.kv_rel_error for s in segs),
        "top1_agree": _mean(float(r.top1_agree) for r in measured),
        "first_token_kl": _mean(r.first_token_kl for r in measured),
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
        "p10": float(np.percentile(a, 10)),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
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
    gates: dict[str, int] = {}
    for d in details:
        if "gate" in d:
            gates[d["gate"]] = gates.get(d["gate"], 0) + 1
    out: dict = {**counters, "segments": statuses}
    if gates:
        out["gate"] = gates
        out["gate_entropy"] = _distribution([d["entropy"] for d in details if "entropy" in d])
        out["compare_tokens"] = _distribution([d["compare_tokens"] for d in details if "compare_tokens" in d])
        out["anchors_used"] = _distribution([d["anchors_used"] for d in details if "anchors_used" in d])
    return out
