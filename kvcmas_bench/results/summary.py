"""Aggregate per-sample and per-request records into a run summary (pandas)."""

from __future__ import annotations

import math
from dataclasses import asdict

import pandas as pd

from .request import RequestRecord


def _mean(series) -> float | None:
    return None if len(series) == 0 else float(series.mean())


def records_frame(requests: list[RequestRecord]) -> pd.DataFrame:
    """One row per request record, every declared field a column (segments as lists of dicts)."""
    return pd.DataFrame([asdict(r) for r in requests])


def summarize(samples: list[dict], requests: list[RequestRecord], meta: dict) -> dict:
    """Accuracy, latency, TTFT, memory and reuse ratio of a run, overall and per agent."""
    s = pd.DataFrame(samples)
    r = records_frame(requests)
    out = {**meta, "n": len(s)}
    if s.empty:
        return out
    out["accuracy"] = float(s["correct"].mean())
    out["latency_s"] = float(s["latency_s"].mean())
    out["latency_s_p50"] = float(s["latency_s"].median())
    if not r.empty:
        out["ttft_s"] = float(r["ttft_s"].mean())
        out["ttft_s_p50"] = float(r["ttft_s"].median())
        out["ttft_s_p90"] = float(r["ttft_s"].quantile(0.9))
        out["e2e_s"] = float(r["e2e_s"].mean())
        out["peak_mem_bytes"] = int(r["peak_mem_bytes"].max())
        out["peak_rss_bytes"] = int(r["peak_rss_bytes"].max())
        out["kv_state_peak_bytes"] = int(r["kv_state_bytes"].max())
        out["method_state_peak_bytes"] = int(r["method_state_bytes"].max())
        out["prefilled_tokens"] = int(r["prefilled_tokens"].sum())
        out["reused_tokens"] = int(r["reused_tokens"].sum())
        out["reference_tokens"] = int(r["reference_tokens"].sum())
        out["recomputed_token_layers"] = int(r["recomputed_token_layers"].sum())
        out["reuse_ratio"] = reuse_ratio(r)
        out["per_agent"] = {
            agent: {
                "ttft_s": float(g["ttft_s"].mean()),
                "e2e_s": float(g["e2e_s"].mean()),
                "reuse_ratio": reuse_ratio(g),
            }
            for agent, g in r.groupby("agent", sort=False)
        }
        out["per_slot"] = per_slot_reuse(r)
        fid = r.dropna(subset=["first_token_kl"]) if "first_token_kl" in r else r.iloc[0:0]
        if not fid.empty:
            out["fidelity"] = {
                "top1_agree": float(fid["top1_agree"].mean()),
                "first_token_kl": float(fid["first_token_kl"].mean()),
                "kv_rel_error": _mean(fid["kv_rel_error"].dropna()),
            }
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
