"""Console tables of the jobs (rich). The full figures are in the output files; the tables show the
key columns with units in the headers."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table


def fmt(v, unit: str = "") -> str:
    """A table cell: ``-`` for missing values, MiB for bytes, 3 decimals for seconds."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "B":
        return f"{v / 2**20:.1f} MiB"
    if unit == "s":
        return f"{v:.3f}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_run_summary(summary: dict, console: Console) -> None:
    t = Table(title=f"{summary['method']} on {summary['workload']} ({summary.get('model')})")
    for col in ("n", "accuracy", "latency (s)", "TTFT (s)", "TTFT p90 (s)", "peak mem", "KV+state peak", "rho"):
        t.add_column(col, justify="right")
    t.add_row(
        fmt(summary.get("n")),
        fmt(summary.get("accuracy")),
        fmt(summary.get("latency_s")),
        fmt(summary.get("ttft_s")),
        fmt(summary.get("ttft_s_p90")),
        fmt(summary.get("peak_mem_bytes"), "B"),
        fmt(summary.get("kv_state_peak_bytes"), "B"),
        fmt(summary.get("reuse_ratio")),
    )
    console.print(t)
    acc = summary.get("accounting") or {}
    line = accounting_line(acc)
    if line:
        console.print(line)
    if "fidelity" in summary:
        f = summary["fidelity"]
        console.print(
            f"fidelity: top-1 agreement {fmt(f['top1_agree'])}, first-token KL "
            f"{fmt(f['first_token_kl'])}, relative KV error {fmt(f['kv_rel_error'])} "
            f"(all {f.get('segments', '?')} shared segments)"
        )
        per = [fmt(a.get("kv_rel_error")) for a in f.get("per_agent", [])]
        if per:
            console.print(f"  KV error per agent, in execution order: {' / '.join(per)}")


ACCOUNTING_LABELS = (
    ("accepted", "accepted"),
    ("dense_fallback", "dense fallbacks"),
    ("nonfinite_fallback", "non-finite"),
    ("corrected", "corrected"),
    ("uncalibrated", "uncalibrated"),
    ("anchors_inserted", "anchors +"),
    ("anchors_evicted", "anchors -"),
)


def accounting_line(acc: dict) -> str:
    """One line of a method's key counters (empty for methods that count nothing)."""
    parts = [f"{label} {acc[k]}" for k, label in ACCOUNTING_LABELS if acc.get(k)]
    ent = acc.get("gate_entropy") or {}
    if ent.get("n"):
        parts.append(f"gate entropy p50 {fmt(ent['p50'])} (n {ent['n']})")
    segs = acc.get("segments") or {}
    if segs:
        parts.append("segments " + ", ".join(f"{k} {v}" for k, v in sorted(segs.items())))
    return ("method: " + "; ".join(parts)) if parts else ""


def print_sweep_table(summary: dict, console: Console) -> None:
    t = Table(
        title=f"serve-sweep ({summary.get('model')}; engine {summary.get('engine')}; "
        "QPS = trajectories/s, 0 = single stream)"
    )
    for col in (
        "method",
        "shared",
        "qps",
        "util",
        "TTFT p50 (s)",
        "p90",
        "p99",
        "mean",
        "tok/s",
        "peak mem",
        "KV+state",
        "rho",
    ):
        t.add_column(col, justify="right" if col != "method" else "left", no_wrap=col == "method")
    for r in summary["rows"]:
        t.add_row(
            r["method"],
            str(r["shared_tokens"]),
            fmt(r["qps"]),
            fmt(r["utilization"]),
            fmt(r["ttft_p50_s"], "s"),
            fmt(r["ttft_p90_s"], "s"),
            fmt(r["ttft_p99_s"], "s"),
            fmt(r["ttft_mean_s"], "s"),
            fmt(r["throughput_tok_s"]),
            fmt(r["peak_mem_bytes"], "B"),
            fmt(r["kv_state_peak_bytes"], "B"),
            fmt(r["reuse_ratio"]),
        )
    console.print(t)
