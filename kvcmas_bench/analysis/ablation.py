"""Figures and table columns of the ablation sweeps (``ablate``) from their one-row-per-point table.

Every line carries a ``gid`` ``<metric>:<series>`` (``reuse_ratio:kvcmas scaled``), every Pareto
series ``pareto-<metric>:<series>``, so tests can read what was drawn.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from ..report.columns import Column  # noqa: E402
from ..report.plots import COLORS, wrap  # noqa: E402

METRICS = {
    "accuracy": "accuracy",
    "answer_agreement": "answer agreement with NonShared",
    "first_token_agreement": "first-token agreement with NonShared",
    "reuse_ratio": "reuse ratio rho",
    "kv_rel_error": "KV relative error vs dense",
    "ttft_mean_s": "TTFT, mean per request (s)",
    "latency_mean_s": "E2E latency per sample (s)",
    "throughput_tok_s": "generated tokens / E2E s",
    "method_state_peak_bytes": "method state (MiB)",
    "peak_mem_bytes": "peak memory (MiB)",
}
#: x axis and panels per ablation kind
PANELS = {
    "rank": ("ranks", ["answer_agreement", "kv_rel_error", "reuse_ratio", "method_state_peak_bytes"]),
    "anchors": ("V", ["answer_agreement", "kv_rel_error", "reuse_ratio", "method_state_peak_bytes"]),
    "tau": ("tau", ["reuse_ratio", "answer_agreement", "kv_rel_error", "ttft_mean_s"]),
    "agents": ("agents", ["ttft_mean_s", "throughput_tok_s", "answer_agreement", "peak_mem_bytes"]),
    "rounds": ("rounds", ["ttft_mean_s", "throughput_tok_s", "answer_agreement", "peak_mem_bytes"]),
}
PARAM_COLUMNS = {
    "rank": [Column("r_C", "r_C", "text", 0), Column("r_D", "r_D", "text", 0)],
    "anchors": [Column("V", "V", "int", 0)],
    "tau": [Column("gate", "gate", "text", 0), Column("tau", "tau", "num", 0), Column("rho", "nominal rho", "num", 2)],
    "agents": [Column("agents", "agents", "int", 0)],
    "rounds": [Column("rounds", "rounds", "int", 0)],
}
COLUMNS = [
    Column("n", "n", "int", 7),
    Column("accuracy", "accuracy", "acc", 3),
    Column("answer_agreement", "agree w/ NonShared", "acc", 0),
    Column("first_token_agreement", "first-token agree", "acc", 4),
    Column("reuse_ratio", "rho", "rho", 0),
    Column("gate_accept_share", "gated tokens accepted", "acc", 5),
    Column("kv_rel_error", "KV rel. error", "err", 1),
    Column("ttft_mean_s", "TTFT (s)", "s", 2),
    Column("latency_mean_s", "E2E (s)", "s", 6),
    Column("throughput_tok_s", "tok/s", "num", 6),
    Column("method_state_peak_bytes", "state (MiB)", "MiB", 5),
    Column("peak_mem_bytes", "peak mem (MiB)", "MiB", 8),
]


def table_columns(kind: str, df: pd.DataFrame) -> list[Column]:
    """The columns of one ablation's table present in ``df`` (empty ones left out)."""
    cols = [Column("method", "method", "text", 0, "left")] + PARAM_COLUMNS.get(kind, []) + COLUMNS
    return [c for c in cols if c.key in df and df[c.key].notna().any()]


def series_name(row) -> str:
    """``kvcmas scaled`` for a gated point of the tau sweep, else the method."""
    gate = row.get("gate") if hasattr(row, "get") else None
    return f"{row['method']} {gate}" if isinstance(gate, str) and gate else str(row["method"])


def _style(series: str) -> dict:
    """One colour per method (as in the report); the paper gate dashed with square markers."""
    method, _, gate = series.partition(" ")
    paper = gate == "paper"
    return {"color": COLORS.get(method, "gray"), "ls": "--" if paper else "-", "marker": "s" if paper else "o"}


def _x(kind: str, df: pd.DataFrame) -> pd.Series:
    if kind == "rank":
        return df.apply(lambda r: f"{_lab(r['r_C'])}/{_lab(r['r_D'])}", axis=1)
    return df[PANELS[kind][0]]


def _lab(v) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "full"
    return str(int(v)) if isinstance(v, (int, float)) else str(v)


def _scale(metric: str, values: pd.Series) -> pd.Series:
    return values.astype(float) / 2**20 if metric.endswith("_bytes") else values.astype(float)


def sweep_figure(df: pd.DataFrame, kind: str, title: str):
    """Each panel metric vs the swept value, one line per series (method, and gate for tau); the
    NonShared reference as a dashed line where it has a value. Returns (figure, axes list)."""
    xname, metrics = PANELS[kind]
    pts = df[df["method"] != "nonshared"].copy()
    if kind == "tau":
        pts = pts[pts["tau"].notna()] if "tau" in pts else pts.iloc[0:0]
    pts["_x"] = _x(kind, pts) if len(pts) else []
    pts["_series"] = [series_name(r) for _, r in pts.iterrows()]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.0 * len(metrics), 3.6))
    refs = df[df["method"] == "nonshared"]
    for ax, metric in zip(axes, metrics):
        if metric not in pts:
            ax.set_visible(False)
            continue
        for series, g in pts.groupby("_series", sort=False):
            g = g.dropna(subset=[metric])
            g = g if kind == "rank" else g.sort_values("_x")
            ax.plot(
                list(g["_x"]), list(_scale(metric, g[metric])), label=series, gid=f"{metric}:{series}", **_style(series)
            )
        if metric in refs and refs[metric].notna().any() and kind not in ("agents", "rounds"):
            ax.axhline(float(_scale(metric, refs[metric].dropna()).iloc[0]), color="gray", ls="--", lw=1)
        if kind in ("agents", "rounds") and metric in refs:
            r = refs.dropna(subset=[metric]).sort_values(kind)
            ax.plot(list(r[kind]), list(_scale(metric, r[metric])), color="gray", ls="--", marker="x",
                    label="nonshared", gid=f"{metric}:nonshared")  # fmt: skip
        ax.set_xlabel("r_C / r_D" if kind == "rank" else xname)
        ax.set_ylabel(METRICS.get(metric, metric), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle(wrap(title, fig, 9), fontsize=9)
    fig.tight_layout()
    return fig, list(axes)


def pareto_figure(df: pd.DataFrame, title: str):
    """Fidelity vs measured rho for every point of the tau sweep (paper: fidelity at matched rho):
    KV relative error (lower is better), first-token and answer agreement with NonShared (higher is
    better); one line per series (KVCMAS/KVComm per gate along tau, the recomputation methods along
    rho). Returns (figure, axes list)."""
    pts = df[df["method"] != "nonshared"].dropna(subset=["reuse_ratio"]).copy()
    pts["_series"] = [series_name(r) for _, r in pts.iterrows()]
    metrics = [
        m for m in ("kv_rel_error", "first_token_agreement", "answer_agreement") if m in pts and pts[m].notna().any()
    ]
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(5.0 * max(len(metrics), 1), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for series, g in pts.dropna(subset=[metric]).groupby("_series", sort=False):
            g = g.sort_values("reuse_ratio")
            ax.plot(
                list(g["reuse_ratio"]), list(g[metric]), label=series, gid=f"pareto-{metric}:{series}", **_style(series)
            )
        ax.set_xlabel("measured reuse ratio rho")
        ax.set_ylabel(METRICS[metric])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle(wrap(title, fig, 9), fontsize=9)
    fig.tight_layout()
    return fig, list(axes[0])


def replay_frame(decisions: list[tuple[list[float], int]], taus, gate_temperature: float | None = None) -> pd.DataFrame:
    """The share of gated tokens each gate would accept at every tau, replayed on recorded gate
    decisions (per decision: the anchors' distances and the segment's tokens). Rows: gate, tau,
    accepted_share, decisions. ``gate_temperature``: the scaled gate's (None: the methods' default)."""
    from ..ops.gate import DEFAULT_GATE_TEMPERATURE, GATES, acceptance_curve, entropy_of

    if gate_temperature is None:
        gate_temperature = DEFAULT_GATE_TEMPERATURE

    rows = []
    for gate in GATES:
        ent = [(entropy_of(d, gate, gate_temperature), n) for d, n in decisions]
        for t, share in zip(taus, acceptance_curve(ent, taus)):
            rows.append({"gate": gate, "tau": float(t), "accepted_share": share, "decisions": len(ent)})
    return pd.DataFrame(rows)


def replay_figure(df: pd.DataFrame, title: str):
    """Accepted share of gated tokens vs tau per gate (lines ``replay:<gate>``). Returns (figure, axes)."""
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    for gate, g in df.groupby("gate", sort=False):
        ax.plot(list(g["tau"]), list(g["accepted_share"]), ls="--" if gate == "paper" else "-",
                label=f"{gate} gate", gid=f"replay:{gate}")  # fmt: skip
    ax.set_xlabel("tau")
    ax.set_ylabel("share of gated tokens accepted")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig, ax
