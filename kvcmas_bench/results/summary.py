"""Aggregate per-sample and per-request records into a run summary (pandas).

Every figure is computed from the records, so a report can recompute any other definition from
``requests.jsonl``; ``DEFINITIONS`` (written into ``summary.json``) states the ones used here.

:func:`run_figures` is the one definition of a run's figures (accuracy with its standard error and
interval, latency, TTFT mean/p50/p90, E2E, memory, method state, rho, KV error, top-1 agreement,
first-token KL): ``summary.json`` (:func:`summarize`) and the report's Table 1
(:func:`kvcmas_bench.report.tables.run_metrics`) both take them from it, under the same names.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pandas as pd

from .frames import request_row
from .request import RequestRecord
from .stats import percentile, proportion

DEFINITIONS = {
    "accuracy": "share of samples whose final answer the workload scores correct; accuracy_se = "
    "sqrt(p(1-p)/n) (binomial, divisor n), accuracy_ci_low/high = the 95% Wilson score interval",
    "latency_s": "sum of the agents' end-to-end times per sample, mean (latency_s) and median (latency_s_p50, "
    "the 50th percentile, linear interpolation) over samples",
    "ttft_s": "time to first token per agent request: mean (ttft_s), 50th and 90th percentiles (ttft_s_p50, "
    "ttft_s_p90; linear interpolation, numpy.percentile) over requests; e2e_s: mean end-to-end time per request",
    "peak_mem_bytes": "max over requests of the device peak (CUDA) or the process peak RSS (CPU); "
    "kv_state_peak_bytes: max of the live KV cache plus method state; method_state_bytes: max over requests "
    "of the method's own state (anchor pools, references, calibration tables)",
    "reuse_ratio": "rho = (shared token, layer) entries served by reuse / entries of reuse-eligible shared "
    "segments. Eligibility is fixed before the method runs, by method family and segment: source-based "
    "methods (nonshared, fullshared, cacheblend, droidspeak, relaycaching, chained kvcmas) count the shared "
    "segments that have a source; context-free-reference methods (kvcomm, kvcmas-nonchained, graphflow) "
    "count every shared segment, the first agent's included. A dense fallback stays in the denominator; "
    "recomputed (token, layer) entries are not served by reuse. Per segment: eligible, reused_tokens, "
    "prefilled_tokens, reference_tokens, recomputed_token_layers in requests.jsonl.",
    "fidelity.kv_rel_error": "||C_method - C_full||_F / ||C_full||_F over K and V of one shared segment, C_full "
    "the rows of a full dense prefill of the same prompt (one forward from position 0), averaged over every "
    "shared segment of every request (dense segments included: after a corrected one they differ from C_full; "
    "otherwise only by float rounding). Per segment, local_kv_rel_error in requests.jsonl is the conditional "
    "figure: against a dense prefill of the segment over the cache as the method built it",
    "fidelity.top1_agree": "share of requests whose first generated token equals the dense prefill's, with "
    "top1_agree_se and the 95% Wilson interval as for accuracy (requests counted as independent trials); "
    "fidelity.first_token_kl: mean KL of the first token's distribution from the dense one",
    "fidelity.per_agent": "the same per workflow node, in execution order",
    "fidelity.per_layer": "per-layer relative error, averaged over every shared segment",
    "fidelity.by_status": "mean relative error of the segments with each materialization status",
    "accounting": "sums over requests of the methods' counters (accepted corrections, dense and non-finite "
    "fallbacks, anchors inserted/evicted, uncalibrated relations) and segment statuses; gate entropy, "
    "comparison-prefix and anchors-used distributions over the gate decisions",
}
#: request token counters summed over a run
TOKEN_SUMS = ("prefilled_tokens", "reused_tokens", "eligible_tokens", "reference_tokens", "recomputed_token_layers")
#: the figures of :func:`run_figures` that ``summary.json`` keeps under ``fidelity``
FIDELITY_KEYS = (
    "kv_rel_error",
    "top1_agree",
    "top1_agree_se",
    "top1_agree_ci_low",
    "top1_agree_ci_high",
    "first_token_kl",
)


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(vals)) if vals else None


def _max(s: pd.Series) -> int | None:
    s = s.dropna()
    return int(s.max()) if len(s) else None


def records_frame(requests: list[RequestRecord]) -> pd.DataFrame:
    """One row per request record, every declared field a column (segments as lists of dicts)."""
    return pd.DataFrame([asdict(r) for r in requests])


def flat_frame(requests: list[RequestRecord]) -> pd.DataFrame:
    """The request records as the flat rows :func:`run_figures` reads (``frames.request_row``)."""
    return pd.DataFrame([request_row(r) for r in requests])


def run_figures(samples: pd.DataFrame, requests: pd.DataFrame) -> dict:
    """Every figure of one run from its sample rows and flat request rows (``frames.request_row``):
    the one definition behind ``summary.json``, Table 1 and the exported frames."""
    out: dict = {"n": len(samples)}
    if samples.empty:
        return out
    correct = samples["correct"].astype(bool)
    out.update(proportion(int(correct.sum()), len(correct), "accuracy"))
    if "latency_s" in samples:
        lat = samples["latency_s"].dropna().astype(float)
        out["latency_s"] = float(lat.mean()) if len(lat) else None
        out["latency_s_p50"] = percentile(lat, 50)
    if requests.empty:
        return out
    r = requests
    out.update(
        ttft_s=float(r["ttft_s"].mean()),
        ttft_s_p50=percentile(r["ttft_s"].dropna(), 50),
        ttft_s_p90=percentile(r["ttft_s"].dropna(), 90),
        e2e_s=float(r["e2e_s"].mean()),
        peak_mem_bytes=_max(r["peak_mem_bytes"]),
        peak_rss_bytes=_max(r["peak_rss_bytes"]),
        kv_state_peak_bytes=_max(r["kv_state_bytes"]),
        method_state_bytes=_max(r["method_state_bytes"]),
        **{k: int(r[k].sum()) for k in TOKEN_SUMS},
        prompt_tokens_mean=float(r["prompt_tokens"].mean()),
        prompt_tokens_max=int(r["prompt_tokens"].max()),
        reuse_ratio=reuse_ratio(r),
    )
    out.update(fidelity_figures(r))
    return out


def fidelity_figures(r: pd.DataFrame) -> dict:
    """KV error (mean over every shared segment with a measured error), top-1 agreement with its
    SE and interval, first-token KL, from flat request rows; None where nothing was measured."""
    n_err = int(r["seg_kv_rel_error_n"].sum())
    top1 = r["top1_agree"].dropna().astype(bool)
    kl = r["first_token_kl"].dropna().astype(float)
    return {
        "kv_rel_error": float(r["seg_kv_rel_error_sum"].sum()) / n_err if n_err else None,
        **proportion(int(top1.sum()), len(top1), "top1_agree"),
        "first_token_kl": float(kl.mean()) if len(kl) else None,
    }


def summarize(samples: list[dict], requests: list[RequestRecord], meta: dict) -> dict:
    """Accuracy, latency, TTFT, memory, reuse ratio, fidelity and method accounting of a run."""
    s = pd.DataFrame(samples)
    figures = run_figures(s, flat_frame(requests))
    out = {**meta, **{k: v for k, v in figures.items() if k not in FIDELITY_KEYS}}
    if s.empty or not requests:
        return out
    r = records_frame(requests)
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
