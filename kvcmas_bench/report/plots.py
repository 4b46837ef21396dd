"""Report figures (matplotlib, Agg): Pareto views in the manner of the paper's Figure 4, accuracy
vs reuse ratio for runs at several rho/tau, and the TTFT-vs-QPS figures of serve-sweeps.

Pareto view: one point per method (x: E2E latency or TTFT, lower is better; y: accuracy or
agreement with NonShared, higher is better), the Pareto frontier as a staircase through the
non-dominated points, and the rectangle spanned by FullShared and NonShared shaded. The axes are
framed on that region (extended by its own size on each side); a point outside the frame is drawn
on the border (hollow marker) and labelled with its true values. Proportions on the y axis
(accuracy, agreement) carry their 95% Wilson interval as an error bar. Artists carry ``gid``s
(``point:<label>``, ``clamped:<label>``, ``ci:<label>``, ``frontier``, ``baseline-region``,
``nonshared-ref``) so tests can read what was drawn.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from ..registry import LiveMapping  # noqa: E402
from ..serving.plots import LABELS, plot_ttft  # noqa: E402

X_AXES = {
    "latency_mean_s": ("E2E latency per sample (s)", "E2E latency"),
    "ttft_mean_s": ("TTFT, mean per request (s)", "TTFT"),
}
Y_AXES = {"accuracy": "accuracy", "answer_agreement": "answer agreement with NonShared"}


def _colors() -> dict[str, str]:
    from ..methods import method_colors  # lazily: the methods import torch

    return method_colors()


#: one colour per method, the same in every figure (the classes' ``color``, else the next free one)
COLORS = LiveMapping(_colors)


@dataclass
class Figure:
    """A written figure: file stem, caption, PNG and SVG paths."""

    name: str
    caption: str
    png: Path
    svg: Path
    #: what :func:`~kvcmas_bench.report.figcheck.figure_problems` found when it was saved (the
    #: report lists them; none is expected)
    problems: list[str] = field(default_factory=list)


def display(label: str) -> str:
    """``kvcmas rho=0.8`` -> ``KVCMAS rho=0.8``."""
    method, _, rest = label.partition(" ")
    return LABELS.get(method, method) + (f" {rest}" if rest else "")


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto-optimal points for (minimal x, maximal y), by increasing x."""
    out: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or y > out[-1][1]:
            out.append((x, y))
    return out


def _frame(values: list[float], base: list[float], floor: float, clip: tuple[float, float]) -> tuple[float, float]:
    """Axis limits: the baselines' interval extended by its size (at least ``floor``) on each side,
    shrunk to the data where the data lie inside, clipped to ``clip``."""
    lo_b, hi_b = min(base), max(base)
    span = max(hi_b - lo_b, floor, 1e-6)
    pad = max(0.08 * span, 0.5 * floor)
    lo = max(lo_b - span, min(values) - pad, clip[0])
    hi = min(hi_b + span, max(values) + pad, clip[1])
    return lo, hi


def meta_line(df: pd.DataFrame) -> str:
    """Model, device and context length of the runs of one workload, for titles."""
    models = ", ".join(sorted({str(m) for m in df["model"].dropna()})) or "?"
    devices = ", ".join(sorted({str(d) for d in df["device"].dropna()})) or "?"
    ctx = ""
    if "prompt_tokens_mean" in df and df["prompt_tokens_mean"].notna().any():
        ctx = (
            f"; context: prompt {df['prompt_tokens_mean'].mean():.0f} tokens mean,"
            f" {int(df['prompt_tokens_max'].max())} max"
        )
    return f"{models} on {devices}{ctx}"


def wrap(text: str, fig, fontsize: float, chars: int | None = None) -> str:
    """``text`` wrapped (each of its lines) to ``chars`` characters, by default an estimate of the
    figure's width at ``fontsize`` (a wide glyph is 0.7 em): no title or subtitle is cut at the edge."""
    chars = chars or max(20, int(fig.get_figwidth() * 72 / (0.7 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.splitlines())


def _fit_title(fig, ax, title: str, fontsize: float = 9) -> None:
    """The title wrapped to the widest width that the drawn figure holds."""
    chars = int(fig.get_figwidth() * 72 / (0.55 * fontsize))
    r = fig.canvas.get_renderer()
    for _ in range(8):
        ax.set_title(wrap(title, fig, fontsize, chars), fontsize=fontsize)
        fig.tight_layout()
        bb = ax.title.get_window_extent(r)
        if bb.x0 >= fig.bbox.x0 and bb.x1 <= fig.bbox.x1:
            return
        chars = int(chars * 0.9)


def _finish(fig, ax, ylabel: str, title: str):
    """The y label, title, grid and legend every scatter figure of the report shares: the title
    wrapped to the figure, the legend below the axes (never over a point or a label), then every
    point label placed where it overlaps nothing (:func:`place_labels`)."""
    ax.set_ylabel(ylabel)
    ax.set_xlabel(wrap(ax.get_xlabel(), fig, 10))
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=7, frameon=False)
    _fit_title(fig, ax, title)
    place_labels(fig, ax)
    return fig, ax


#: label offsets tried around a point, in points (dx, dy, horizontal, vertical alignment): near
#: spots first, then stacks above and below on either side (a label far from its point gets a
#: leader line)
_SPOTS = [
    (5, 2, "left", "bottom"),
    (5, -2, "left", "top"),
    (-5, 2, "right", "bottom"),
    (-5, -2, "right", "top"),
    (8, 0, "left", "center"),
    (-8, 0, "right", "center"),
    (0, 7, "center", "bottom"),
    (0, -7, "center", "top"),
] + [
    (dx, sign * (2 + 9 * k), ha, "bottom" if sign > 0 else "top")
    for k in range(1, 8)
    for sign in (1, -1)
    for dx, ha in ((5, "left"), (-5, "right"))
]


def place_labels(fig, ax) -> None:
    """Move each point label (annotation) of ``ax`` to the first spot around its point where it
    stays inside the axes and overlaps no label placed before it; where none is free, to the spot
    of least overlap. Points are taken left to right."""
    from .figcheck import overlap, text_box

    anns = sorted((t for t in ax.texts if t.get_text().strip() and hasattr(t, "xyann")), key=lambda t: t.xy[0])
    if not anns:
        return
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    abox = ax.get_window_extent(r)
    taken = []
    for ann in anns:
        best, best_cost = None, None
        for dx, dy, ha, va in _SPOTS:
            ann.xyann, ann.xycoords = (dx, dy), ann.xycoords
            ann.set_ha(ha)
            ann.set_va(va)
            bb = text_box(ann, r)
            outside = max(0.0, abox.x0 - bb.x0) + max(0.0, bb.x1 - abox.x1) + max(0.0, abox.y0 - bb.y0)
            outside += max(0.0, bb.y1 - abox.y1)
            cost = 1000 * outside + sum(
                (min(bb.x1, o.x1) - max(bb.x0, o.x0)) * (min(bb.y1, o.y1) - max(bb.y0, o.y0))
                for o in taken
                if overlap(bb, o)
            )
            if best_cost is None or cost < best_cost:
                best, best_cost = (dx, dy, ha, va), cost
            if cost == 0:
                break
        dx, dy, ha, va = best
        ann.xyann = (dx, dy)
        ann.set_ha(ha)
        ann.set_va(va)
        if abs(dy) > 10:  # far from its point: a leader line says whose label it is
            lead = {"arrowstyle": "-", "lw": 0.5, "color": "gray", "shrinkA": 0, "shrinkB": 3}
            text, fontsize, gid = ann.get_text(), ann.get_fontsize(), ann.get_gid()
            xy = ann.xy
            ann.remove()
            ann = ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                              fontsize=fontsize, gid=gid, arrowprops=lead)  # fmt: skip
        taken.append(text_box(ann, r))


def pareto_axes(df: pd.DataFrame, x: str, y: str, title: str):
    """The Pareto view of one workload's Table 1 rows; returns (figure, axes)."""
    pts = df.dropna(subset=[x, y])
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    base = {m: pts[pts["method"] == m] for m in ("fullshared", "nonshared")}
    xs, ys = pts[x].astype(float).tolist(), pts[y].astype(float).tolist()
    if all(len(b) for b in base.values()):
        bx = [float(base[m][x].iloc[0]) for m in base]
        by = [float(base[m][y].iloc[0]) for m in base]
        xlim = _frame(xs, bx, 0.2 * max(bx), (0.0, float("inf")))
        ylim = _frame(ys, by, 0.1, (-0.02, 1.02))
        _shade(ax, bx, by, ylim)
    else:
        xlim = _frame(xs, xs, 0.2 * max(xs), (0.0, float("inf")))
        ylim = _frame(ys, ys, 0.1, (-0.02, 1.02))
    ylim = _with_intervals(pts, y, ylim)
    for i in range(len(xs)):
        _point(ax, pts["label"].iloc[i], xs[i], ys[i], xlim, ylim)
        if xlim[0] <= xs[i] <= xlim[1]:
            _ci(ax, pts.iloc[i], y, xs[i])
    front = frontier(list(zip(xs, ys)))
    ax.plot(
        [p[0] for p in front],
        [p[1] for p in front],
        drawstyle="steps-post",
        color="black",
        lw=1,
        ls="--",
        marker="o",
        ms=11,
        mfc="none",
        mec="black",
        gid="frontier",
        label="Pareto frontier",
    )
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_xlabel(X_AXES[x][0])
    return _finish(fig, ax, Y_AXES[y], title)


def _with_intervals(pts: pd.DataFrame, y: str, ylim: tuple[float, float]) -> tuple[float, float]:
    """``ylim`` widened to hold every plotted 95% interval of ``y`` (a margin of 4% of the range
    around them), within [-0.02, 1.02]: an interval is never cut by the axes."""
    lo_c, hi_c = f"{y}_ci_low", f"{y}_ci_high"
    if lo_c not in pts or hi_c not in pts:
        return ylim
    lo = pd.to_numeric(pts[lo_c], errors="coerce").dropna()
    hi = pd.to_numeric(pts[hi_c], errors="coerce").dropna()
    if lo.empty or hi.empty:
        return ylim
    a, b = min(ylim[0], float(lo.min())), max(ylim[1], float(hi.max()))
    pad = 0.04 * (b - a)
    return max(-0.02, min(ylim[0], float(lo.min()) - pad)), min(1.02, max(ylim[1], float(hi.max()) + pad))


def _shade(ax, bx: list[float], by: list[float], ylim: tuple[float, float]) -> None:
    """The region between FullShared and NonShared (a vertical band when their y are equal)."""
    y0, y1 = min(by), max(by)
    if y1 - y0 < 1e-12:
        y0, y1 = ylim
    ax.add_patch(
        Rectangle(
            (min(bx), y0),
            max(bx) - min(bx),
            y1 - y0,
            alpha=0.12,
            color="tab:blue",
            lw=0,
            gid="baseline-region",
            label="between FullShared and NonShared",
        )
    )


def _point(ax, label: str, x: float, y: float, xlim, ylim, dy: int = 4) -> None:
    cx, cy = min(max(x, xlim[0]), xlim[1]), min(max(y, ylim[0]), ylim[1])
    inside = (cx, cy) == (x, y)
    name = display(label)
    color = COLORS.get(label.partition(" ")[0], "gray")
    ax.scatter(
        [cx],
        [cy],
        s=40,
        marker="o" if inside else "D",
        facecolors=color if inside else "none",
        edgecolors=color,
        zorder=4,
        clip_on=False,
        gid=("point:" if inside else "clamped:") + label,
    )
    text = name if inside else f"{name} ({x:.3g}, {y:.3f})"
    ax.annotate(text, (cx, cy), textcoords="offset points", xytext=(4, dy), fontsize=7, gid="label:" + label)


def _ci(ax, row, y: str, x: float, color: str | None = None) -> None:
    """The 95% interval of the proportion ``y`` of one row as a vertical error bar at ``x``."""
    lo, hi = row.get(f"{y}_ci_low"), row.get(f"{y}_ci_high")
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
        return
    label = str(row["label"])
    color = color or COLORS.get(label.partition(" ")[0], "gray")
    ax.plot([x, x], [float(lo), float(hi)], color=color, lw=1, alpha=0.6, zorder=3, gid=f"ci:{label}")
    for v in (float(lo), float(hi)):
        ax.plot([x], [v], marker="_", ms=8, color=color, alpha=0.6, zorder=3)


def rho_axes(df: pd.DataFrame, y: str, title: str):
    """Accuracy (or agreement) vs measured reuse ratio, one line per method with several runs;
    NonShared as a dashed reference line. Returns (figure, axes)."""
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    pts = df.dropna(subset=[y])
    ref = pts[pts["method"] == "nonshared"]
    if len(ref):
        ax.axhline(float(ref[y].iloc[0]), color="gray", ls="--", lw=1, gid="nonshared-ref", label="NonShared")
    for method, g in pts[pts["method"] != "nonshared"].dropna(subset=["reuse_ratio"]).groupby("method", sort=False):
        g = g.sort_values("reuse_ratio")
        ax.plot(
            g["reuse_ratio"],
            g[y],
            marker="o",
            color=COLORS.get(method),
            label=LABELS.get(method, method),
            gid=f"rho:{method}",
        )
        for _, row in g.iterrows():
            _ci(ax, row, y, float(row["reuse_ratio"]), COLORS.get(method))
        for label, vx, vy in zip(g["label"], g["reuse_ratio"], g[y]):
            suffix = label.partition(" ")[2]
            if suffix:
                ax.annotate(
                    suffix, (vx, vy), textcoords="offset points", xytext=(4, 4), fontsize=7, gid=f"label:{label}"
                )
    ax.set_xlabel("reuse ratio rho (served (token, layer) entries / eligible); bars: 95% Wilson interval")
    return _finish(fig, ax, Y_AXES[y], title)


def save(fig, out_dir: Path, name: str, caption: str) -> Figure:
    out_dir.mkdir(parents=True, exist_ok=True)
    from .figcheck import figure_problems

    png, svg = out_dir / f"{name}.png", out_dir / f"{name}.svg"
    problems = figure_problems(fig)
    fig.savefig(png, dpi=120)
    fig.savefig(svg)
    plt.close(fig)
    return Figure(name, caption, png, svg, problems)


def workload_figures(df: pd.DataFrame, workload: str, out_dir: Path, stem: str | None = None) -> list[Figure]:
    """Every Pareto view of one Table 1's rows (``workload``: its title, ``stem``: its file-name stem,
    default the title), and the accuracy-vs-rho view when a method ran at several settings."""
    stem = stem or workload
    meta = meta_line(df) + "; bars: 95% Wilson interval"
    figs = []
    for y in ("accuracy", "answer_agreement"):
        if y not in df or df[y].isna().all():
            continue
        for x, (_, short) in X_AXES.items():
            if x not in df or df[x].isna().all():
                continue
            caption = f"{workload}: {Y_AXES[y]} vs {short}"
            fig, _ = pareto_axes(df, x, y, f"{caption}\n{meta}")
            figs.append(save(fig, out_dir, f"{stem}_{y}_vs_{x.removesuffix('_s').removesuffix('_mean')}", caption))
    several = df[df["method"] != "nonshared"].groupby("method")["label"].nunique()
    if (several > 1).any() and "reuse_ratio" in df:
        for y in ("accuracy", "answer_agreement"):
            if y in df and df[y].notna().any():
                caption = f"{workload}: {Y_AXES[y]} vs reuse ratio"
                fig, _ = rho_axes(df, y, f"{caption}\n{meta}")
                figs.append(save(fig, out_dir, f"{stem}_{y}_vs_rho", caption))
    return figs


def sweep_figures(rows: list[dict], name: str, note: str, out_dir: Path, accumulated: bool) -> list[Figure]:
    """TTFT p50/p90 vs QPS of one sweep (saturated points ringed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = []
    for stat in ("p50", "p90"):
        png = out_dir / f"{name}_ttft_{stat}.png"
        plot_ttft(rows, png, stat, accumulated=accumulated, note=note)
        figs.append(Figure(png.stem, f"{name}: {stat} TTFT vs QPS", png, png.with_suffix(".svg")))
    return figs
