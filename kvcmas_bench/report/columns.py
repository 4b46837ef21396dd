"""Table columns shared by the console, Markdown and HTML renderings: a header with its unit, a
cell format, and a priority deciding which columns a narrow console drops first."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..results.figures import in_view


@dataclass(frozen=True)
class Column:
    """``key``: the row field; ``header``: its title (units in it); ``kind``: the cell format (see
    :func:`cell`); ``priority``: 0 = always shown on the console, higher numbers dropped first."""

    key: str
    header: str
    kind: str = "num"
    priority: int = 5
    justify: str = "right"
    #: left out of a table when no row has a value
    optional: bool = False


def figure_columns(view: str, lead=()) -> list[Column]:
    """The ``lead`` columns, then one per figure shown in ``view`` (:mod:`kvcmas_bench.results.figures`),
    in the figures' order, with their headers, cell formats and priorities. On the console an estimate
    shows its value only (the report tables add its SE and interval)."""
    cols = list(lead)
    for fig, v in in_view(view):
        kind = "acc" if fig.estimate and view == "console" else fig.kind
        cols.append(Column(fig.name, v.header or fig.header, kind, v.priority, optional=v.optional))
    return cols


def missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def sig(v: float, digits: int = 3) -> str:
    """``digits`` significant digits, without switching to exponents for ordinary magnitudes."""
    if v == 0:
        return "0"
    if abs(v) >= 10 ** (digits - 1):
        return f"{v:.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:.{decimals}f}"


def estimate(p, se=None, lo=None, hi=None) -> str:
    """A proportion with its standard error and 95% interval: ``0.833 ± 0.152 [0.436, 0.970]``
    (the parts that are missing left out)."""
    text = f"{float(p):.3f}"
    if not missing(se):
        text += f" ± {float(se):.3f}"
    if not (missing(lo) or missing(hi)):
        text += f" [{float(lo):.3f}, {float(hi):.3f}]"
    return text


def cell(v, kind: str = "num") -> str:
    """One table cell: ``-`` when missing; ``acc``/``rho``: 3 decimals; ``est``: a proportion, or a
    tuple (p, SE, CI low, CI high) as ``0.833 ± 0.152 [0.436, 0.970]``; ``diff``: signed, 3
    decimals; ``p``: a p-value, 3 significant digits; ``s``: 3 significant digits; ``MiB``: bytes in
    MiB with 1 decimal; ``err``/``kl``: 2-3 significant digits."""
    if kind == "est" and isinstance(v, (tuple, list)):
        return "-" if not v or missing(v[0]) else estimate(*v)
    if missing(v):
        return "-"
    if kind == "text":
        return str(v)
    if kind == "est":
        return f"{float(v):.3f}"
    if kind == "diff":
        return f"{float(v):+.3f}"
    if kind == "p":
        return f"{float(v):.3g}"
    if kind == "int":
        return str(int(v))
    if kind in ("acc", "rho"):
        return f"{float(v):.3f}"
    if kind == "s":
        return sig(float(v))
    if kind == "MiB":
        return f"{float(v) / 2**20:.1f}"
    if kind == "err":
        return f"{float(v):.3g}"
    if kind == "kl":
        return f"{float(v):.2g}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
