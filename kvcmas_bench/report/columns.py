"""Table columns shared by the console, Markdown and HTML renderings: a header with its unit, a
cell format, and a priority deciding which columns a narrow console drops first."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """``key``: the row field; ``header``: its title (units in it); ``kind``: the cell format (see
    :func:`cell`); ``priority``: 0 = always shown on the console, higher numbers dropped first."""

    key: str
    header: str
    kind: str = "num"
    priority: int = 5
    justify: str = "right"


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


def cell(v, kind: str = "num") -> str:
    """One table cell: ``-`` when missing; ``acc``/``rho``: 3 decimals; ``s``: 3 significant
    digits; ``MiB``: bytes in MiB with 1 decimal; ``err``/``kl``: 2-3 significant digits."""
    if missing(v):
        return "-"
    if kind == "text":
        return str(v)
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
