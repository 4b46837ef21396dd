"""TTFT-vs-QPS plots of a serve-sweep (matplotlib, Agg backend), in the layout of the paper's
Fig. 5/8 (one panel per shared-context length, one line per method) and Fig. 6/9 (chained vs
non-chained KVCMAS), and where the TTFT goes (``ttft_parts.png``: stacked own service and queueing
per method and QPS, from the row columns of :func:`kvcmas_bench.serving.metrics.ttft_breakdown`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..registry import LiveMapping  # noqa: E402


def _labels() -> dict[str, str]:
    from ..methods import method_labels  # lazily: the methods import torch

    return method_labels()


def _chain_labels() -> dict[str, str]:
    from ..methods import chain_labels

    return chain_labels()


#: method name -> display name (the classes' ``label``)
LABELS = LiveMapping(_labels)
#: method name -> line name in the chained vs non-chained figure (the classes' ``chain_label``)
CHAINED_LABELS = LiveMapping(_chain_labels)


def sweep_note(summary: dict) -> str:
    """Model, device and the QPS NonShared sustains, for the figures' footnote."""
    note = f"{summary.get('model')} on {summary.get('device')}, engine {summary.get('engine')}"
    caps = [
        f"{c['nonshared_capacity_qps']:.3g} QPS at {s} shared tokens"
        for s, c in (summary.get("capacity") or {}).items()
        if c.get("nonshared_capacity_qps") is not None
    ]
    return note + ("; NonShared sustains < " + ", ".join(caps) if caps else "")


def _shared_label(shared: int, accumulated: bool) -> str:
    k = f"{shared / 1024:g}K" if shared % 128 == 0 and shared >= 1024 else str(shared)
    return f"{k} accumulated output tokens" if accumulated else f"{k} shared tokens"


def plot_ttft(
    rows: Sequence[dict],
    path: Path,
    stat: str = "p50",
    methods: Sequence[str] | None = None,
    labels: dict | None = None,
    title: str | None = None,
    accumulated: bool = False,
    note: str | None = None,
) -> Path:
    """One panel per shared length: TTFT ``stat`` (p50/p90/p99/mean) vs QPS, one line per method;
    saturated points (utilization >= 1) ringed in red. Saved as ``path`` and as SVG next to it."""
    labels = {**LABELS, **(labels or {})}
    key = f"ttft_{stat}_s"
    methods = list(methods) if methods is not None else list(dict.fromkeys(r["method"] for r in rows))
    shared = sorted({r["shared_tokens"] for r in rows})
    qps = sorted({r["qps"] for r in rows})
    pos = {q: i for i, q in enumerate(qps)}  # categorical x axis, as in the paper
    n_legend = len(methods) + any(r.get("saturated") for r in rows)
    width = max(7.0, 4.2 * len(shared))
    ncol = max(1, min(n_legend, 4, int(width // 2.3)))  # about 2.3 in per entry ("saturated (utilization >= 1)")
    rows_legend = -(-n_legend // ncol) if n_legend else 0
    top = 0.93 - 0.06 * rows_legend
    fig, axes = plt.subplots(1, len(shared), figsize=(width, 3.4 + 0.3 * rows_legend), squeeze=False)
    for ax, s in zip(axes[0], shared):
        for m in methods:
            pts = sorted(
                (r["qps"], r[key])
                for r in rows
                if r["method"] == m and r["shared_tokens"] == s and r.get(key) is not None
            )
            if pts:
                ax.plot([pos[q] for q, _ in pts], [v for _, v in pts], marker="o", label=labels.get(m, m))
        _ring_saturated(ax, [r for r in rows if r["shared_tokens"] == s and r["method"] in methods], key, pos)
        ax.set_xticks(range(len(qps)))
        ax.set_xticklabels([f"{q:g}" for q in qps])
        ax.set_xlabel("QPS (trajectories/s; 0 = single stream)")
        ax.set_ylabel(f"{stat} TTFT (s)")
        ax.set_title(_shared_label(s, accumulated))
        ax.grid(alpha=0.3)
    legend: dict = {}
    for ax in axes[0]:
        for h, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, h)
    handles, names = list(legend.values()), list(legend)
    if handles:
        fig.legend(handles, names, loc="upper center", ncol=ncol, frameon=False)
    footer = title or f"{stat} TTFT under load (one-request-at-a-time FCFS server)"
    fig.text(0.5, 0.01, footer + (f"\n{note}" if note else ""), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.09 if note else 0.05, 1, top))
    fig.savefig(path, dpi=120)
    fig.savefig(Path(path).with_suffix(".svg"))
    plt.close(fig)
    return path


def _ring_saturated(ax, rows: Sequence[dict], key: str, pos: dict) -> None:
    """Red rings on the points whose offered load is >= 1 (an unstable queue), with a legend entry."""
    sat = [(pos[r["qps"]], r[key]) for r in rows if r.get("saturated") and r.get(key) is not None]
    if sat:
        ax.scatter(
            [x for x, _ in sat],
            [y for _, y in sat],
            s=160,
            facecolors="none",
            edgecolors="red",
            linewidths=1.5,
            zorder=5,
            gid="saturated",
            label="saturated (utilization >= 1)",
        )


#: the stacked parts of ``ttft_parts.png`` (row column suffix, label, colour, hatch); the queue is
#: one bar part when the engine cannot attribute it (served for real)
PARTS = (
    ("service_shared_dense", "service: dense shared prefill", "#4c72b0", None),
    ("service_shared_reuse", "service: reuse (gate, reference, correction)", "#55a868", None),
    ("service_other", "service: private prefill, first token", "#8c8c8c", None),
    ("queue_other", "queue", "#dd8452", "//"),
    ("queue_dense", "queue behind dense fallbacks", "#c44e52", "//"),
)

#: the parts drawn whole when a row does not split them (engines that serve for real)
WHOLE = (
    ("service", "service (not split)", "#8c8c8c", None),
    ("queue", "queue (not attributed)", "#dd8452", "//"),
)


def _pieces(row: dict, stat: str) -> list[tuple]:
    """The stacked parts of one bar: the finest split the row holds."""
    service = PARTS[:3] if row.get(f"ttft_{stat}_service_shared_dense_s") is not None else WHOLE[:1]
    queue = PARTS[3:] if row.get(f"ttft_{stat}_queue_dense_s") is not None else WHOLE[1:]
    return list(service + queue)


def plot_ttft_parts(
    rows: Sequence[dict], path: Path, accumulated: bool = False, note: str | None = None
) -> Path | None:
    """Where the TTFT goes: one panel per (statistic p50/p90, shared length), per QPS one stacked
    bar per method (own service parts, then queueing, the part behind dense fallbacks on top).
    None when the rows carry no split (summaries written before it existed)."""
    if not any(r.get("ttft_p50_service_s") is not None for r in rows):
        return None
    labels = dict(LABELS)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    shared = sorted({r["shared_tokens"] for r in rows})
    qps = sorted({r["qps"] for r in rows})
    by = {(r["method"], r["shared_tokens"], r["qps"]): r for r in rows}
    width = 0.8 / max(1, len(methods))
    fig, axes = plt.subplots(
        2, len(shared), figsize=(max(7.0, 0.5 * len(qps) * len(methods) * len(shared) + 2), 7.0), squeeze=False
    )
    used: dict = {}
    for row_i, stat in enumerate(("p50", "p90")):
        for ax, s in zip(axes[row_i], shared):
            for mi, m in enumerate(methods):
                for qi, q in enumerate(qps):
                    r = by.get((m, s, q))
                    if r is None or r.get(f"ttft_{stat}_service_s") is None:
                        continue
                    x = qi - 0.4 + width * (mi + 0.5)
                    bottom = 0.0
                    for key, label, colour, hatch in _pieces(r, stat):
                        v = r.get(f"ttft_{stat}_{key}_s")
                        if not v or v <= 0:
                            continue
                        h = ax.bar(x, v, width * 0.9, bottom=bottom, color=colour, hatch=hatch, edgecolor="white")
                        used.setdefault(label, h)
                        bottom += v
                    ax.text(x, bottom, labels.get(m, m), rotation=90, ha="center", va="bottom", fontsize=6)
            ax.set_xticks(range(len(qps)))
            ax.set_xticklabels([f"{q:g}" for q in qps])
            ax.set_xlabel("QPS (trajectories/s; 0 = single stream)")
            ax.set_ylabel(f"{stat} TTFT (s)")
            ax.set_title(f"{stat}, {_shared_label(s, accumulated)}", fontsize=9)
            ax.margins(y=0.25)
            ax.grid(alpha=0.3, axis="y")
    order = [label for _, label, _, _ in PARTS + WHOLE if label in used]
    if order:
        fig.legend(
            [used[k] for k in order], order, loc="upper center", ncol=min(3, len(order)), frameon=False, fontsize=8
        )
    footer = "TTFT at the p50/p90 rank split into the request's own service and its queueing"
    fig.text(0.5, 0.01, footer + (f"\n{note}" if note else ""), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.07 if note else 0.04, 1, 0.9))
    fig.savefig(path, dpi=120)
    fig.savefig(Path(path).with_suffix(".svg"))
    plt.close(fig)
    return path


def plot_all(rows: Sequence[dict], out_dir: Path, accumulated: bool = False, note: str | None = None) -> list[Path]:
    """``ttft_p50.png``, ``ttft_p90.png``, ``ttft_parts.png``; plus ``chained_ttft_p50/p90.png``
    when both KVCMAS variants were run (the methods with a ``chain_label``); each also as ``.svg``.
    ``note``: a footnote line (model, device, capacity)."""
    out_dir = Path(out_dir)
    if not rows:
        return []
    paths = [
        plot_ttft(rows, out_dir / f"ttft_{st}.png", st, accumulated=accumulated, note=note) for st in ("p50", "p90")
    ]
    parts = plot_ttft_parts(rows, out_dir / "ttft_parts.png", accumulated, note)
    if parts is not None:
        paths.append(parts)
    chain = dict(CHAINED_LABELS)
    present = [m for m in chain if m in {r["method"] for r in rows}]
    if len(present) >= 2:
        sub = [r for r in rows if r["method"] in chain]
        for st in ("p50", "p90"):
            paths.append(
                plot_ttft(
                    sub,
                    out_dir / f"chained_ttft_{st}.png",
                    st,
                    methods=present,
                    labels=chain,
                    title=f"{st} TTFT, chained vs non-chained KVCMAS",
                    accumulated=accumulated,
                    note=note,
                )
            )
    return paths
