"""Legibility of a drawn figure, read from matplotlib's own geometry (after ``canvas.draw()``):
what a reader could not read is a problem. Used by the label placement of the report's figures,
by the tests on hand-made frames and on the figures a CI run writes.

Checked: no two text labels (annotations, the legend) overlap; no text leaves the figure; every
plotted point (scatter markers) and every interval end (lines whose ``gid`` starts with ``ci:``)
lies inside its axes.
"""

from __future__ import annotations

import matplotlib.text as mtext
from matplotlib.transforms import Bbox

#: display pixels a box may cross an edge by (antialiasing, rounding)
TOLERANCE = 1.0


def _inside(inner: Bbox, outer: Bbox, tol: float = TOLERANCE) -> bool:
    return (
        inner.x0 >= outer.x0 - tol
        and inner.x1 <= outer.x1 + tol
        and inner.y0 >= outer.y0 - tol
        and inner.y1 <= outer.y1 + tol
    )


def overlap(a: Bbox, b: Bbox, tol: float = TOLERANCE) -> bool:
    """Whether two display boxes share more than ``tol`` pixels in both directions."""
    return min(a.x1, b.x1) - max(a.x0, b.x0) > tol and min(a.y1, b.y1) - max(a.y0, b.y0) > tol


def labels(fig) -> list[mtext.Text]:
    """The point labels of a figure: its annotations that are visible and not empty."""
    return [
        t
        for ax in fig.axes
        for t in ax.texts
        if isinstance(t, mtext.Annotation) and t.get_visible() and t.get_text().strip()
    ]


def figure_problems(fig) -> list[str]:
    """Every legibility problem of ``fig`` as one line each (empty: legible)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    return _texts_outside(fig, r) + _overlaps(fig, r) + [p for ax in fig.axes for p in _data_outside(ax, r)]


def _undrawn_ticks(fig) -> set[int]:
    """Tick labels matplotlib keeps but does not draw (their tick lies outside the view)."""
    out = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                loc = tick.get_loc()
                if loc is None or not lo - 1e-9 * max(1.0, abs(hi)) <= loc <= hi + 1e-9 * max(1.0, abs(hi)):
                    out |= {id(tick.label1), id(tick.label2)}
    return out


def _texts_outside(fig, r) -> list[str]:
    out = []
    skip = _undrawn_ticks(fig)
    for t in fig.findobj(mtext.Text):
        if id(t) not in skip and t.get_visible() and t.get_text().strip() and t.get_figure() is fig:
            if not _inside(text_box(t, r), fig.bbox):
                out.append(f"text {t.get_text()!r} leaves the figure")
    return out


def text_box(t: mtext.Text, r) -> Bbox:
    """The display box of a text's glyphs (an annotation's leader line left out)."""
    if isinstance(t, mtext.Annotation):
        t.update_positions(r)
    return mtext.Text.get_window_extent(t, r)


def _overlaps(fig, r) -> list[str]:
    boxes = [(t.get_text(), text_box(t, r)) for t in labels(fig)]
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is not None and leg.get_visible():
            boxes.append(("legend", leg.get_window_extent(r)))
    return [f"{a!r} overlaps {b!r}" for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1 :] if overlap(ba, bb)]


def _data_outside(ax, r) -> list[str]:
    """Scatter points and interval ends (``ci:`` lines) outside the axes box."""
    abox = ax.get_window_extent(r)
    box = Bbox.from_extents(abox.x0 - TOLERANCE, abox.y0 - TOLERANCE, abox.x1 + TOLERANCE, abox.y1 + TOLERANCE)
    out = []
    for coll in ax.collections:
        offsets = coll.get_offsets()
        if len(offsets) and coll.get_offset_transform() is ax.transData:
            if not all(box.contains(x, y) for x, y in ax.transData.transform(offsets)):
                out.append(f"a point of {coll.get_gid() or 'a scatter'} lies outside the axes")
    for line in ax.lines:
        if str(line.get_gid() or "").startswith("ci:"):
            if not all(box.contains(x, y) for x, y in ax.transData.transform(line.get_xydata())):
                out.append(f"an end of {line.get_gid()} lies outside the axes")
    return out
