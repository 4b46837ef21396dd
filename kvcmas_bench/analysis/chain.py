"""Chained vs non-chained correction error (paper Section 3.2, Figure 3), from run directories
recorded with ``--fidelity``.

Per shared segment the run records its relative KV error against the exact dense cache (overall and
per layer) and its status. Two averages are reported, per workflow node in execution order and per
layer: over **every** shared segment (a dense fallback or an exactly prefilled first agent counts
as 0, as in ``summary.json``) and over the **corrected** segments only (the error of the correction
itself, independent of how often the gate accepted). Under chained correction the first agent is
always exact; a non-chained method corrects it too.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..report.plots import wrap  # noqa: E402
from ..results.frames import read_jsonl  # noqa: E402
from ..results.request import RequestRecord  # noqa: E402


def segment_rows(method: str, workload: str, run_dir: Path) -> list[dict]:
    """One row per shared segment with a measured error: method, node, status, errors per layer."""
    rows = []
    for d in read_jsonl(run_dir / "requests.jsonl", required=False):
        rec = RequestRecord.from_dict(d)
        for s in rec.shared_segments:
            if s.kv_rel_error is None:
                continue
            rows.append(
                {
                    "method": method,
                    "workload": workload,
                    "sample_id": rec.sample_id,
                    "step": rec.step,
                    "node": rec.node,
                    "slot": s.slot,
                    "status": s.status,
                    "kv_rel_error": s.kv_rel_error,
                    "per_layer": list(s.kv_rel_error_per_layer or []),
                }
            )
    return rows


def chain_frames(runs: list[tuple[str, str, Path]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per agent, per layer) frames over ``(method, workload, run directory)`` triples."""
    segs = pd.DataFrame([r for m, w, d in runs for r in segment_rows(m, w, d)])
    if segs.empty:
        return pd.DataFrame(), pd.DataFrame()
    agents = []
    for (w, m, step), g in segs.groupby(["workload", "method", "step"], sort=True):
        corr = g[g["status"] == "corrected"]
        agents.append(
            {
                "workload": w,
                "method": m,
                "step": int(step),
                "node": g["node"].iloc[0],
                "segments": len(g),
                "corrected": len(corr),
                "kv_rel_error": float(g["kv_rel_error"].mean()),
                "kv_rel_error_corrected": float(corr["kv_rel_error"].mean()) if len(corr) else None,
            }
        )
    layers = []
    for (w, m), g in segs.groupby(["workload", "method"], sort=False):
        every = np.asarray([p for p in g["per_layer"] if p], dtype=float)
        corr = np.asarray([p for p, s in zip(g["per_layer"], g["status"]) if p and s == "corrected"], dtype=float)
        for layer in range(every.shape[1] if every.size else 0):
            layers.append(
                {
                    "workload": w,
                    "method": m,
                    "layer": layer,
                    "kv_rel_error": float(every[:, layer].mean()),
                    "kv_rel_error_corrected": float(corr[:, layer].mean()) if corr.size else None,
                }
            )
    return pd.DataFrame(agents), pd.DataFrame(layers)


def chain_figure(agents: pd.DataFrame, layers: pd.DataFrame, title: str):
    """(a) KV error per layer, (b) per agent in execution order, one line per method, solid over every
    shared segment, dashed over corrected ones. Lines carry ``gid`` ``layer:<method>:<all|corrected>``
    and ``agent:<method>:<all|corrected>``. Returns (figure, (axes a, axes b))."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.0, 4.2))
    for i, (m, g) in enumerate(layers.groupby("method", sort=False)):
        for col, which, ls in (("kv_rel_error", "all", "-"), ("kv_rel_error_corrected", "corrected", "--")):
            if g[col].notna().any():
                ax.plot(g["layer"], g[col].astype(float), ls=ls, color=f"C{i}", label=f"{m} ({which})",
                        gid=f"layer:{m}:{which}")  # fmt: skip
    for i, (m, g) in enumerate(agents.groupby("method", sort=False)):
        g = g.sort_values("step")
        ticks = [f"A{s}" for s in g["step"]]
        for col, which, ls in (("kv_rel_error", "all", "-"), ("kv_rel_error_corrected", "corrected", "--")):
            vals = g[col].astype(float)
            if vals.notna().any():
                bx.plot(ticks, vals, ls=ls, marker="o", color=f"C{i}", label=f"{m} ({which})",
                        gid=f"agent:{m}:{which}")  # fmt: skip
    ax.set_xlabel("layer")
    ax.set_ylabel("relative KV error vs dense")
    ax.set_title("(a) across layers", fontsize=9)
    bx.set_xlabel("agent in execution order")
    bx.set_ylabel("relative KV error vs dense")
    bx.set_title("(b) across agents", fontsize=9)
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=7, frameon=False)
    fig.suptitle(wrap(f"{title}: chained vs non-chained correction", fig, 9), fontsize=9)
    fig.tight_layout()
    return fig, (ax, bx)
