"""Percentiles, the uncertainty of the report's proportions and the paired test of two runs on the
same samples: the one definition of each, pure functions (no pandas).

- :func:`percentile`: linear interpolation between the closest ranks (numpy's and pandas'
  default): every pXX, the p50 included (``percentile(values, 50)``, the one median): the ``_p50``
  and ``_p90`` figures of a run's ``summary.json``, the pXX of the serve-sweep rows and the
  accounting distributions; :func:`percentile_rank`: its ranks and weight, for figures that follow
  the same interpolation (the serve-sweep's TTFT parts).
- :func:`binomial_se`: the standard error of a proportion ``k/n`` as sqrt(p (1 - p) / n) (divisor
  ``n``, the maximum-likelihood form; 0 at p = 0 or 1).
- :func:`wilson_interval`: the Wilson score interval (95% by default), which stays inside [0, 1]
  and is not empty at p = 0 or 1 (where the Wald interval p +- 1.96 SE collapses to a point).
- :func:`mcnemar_exact`: the exact McNemar test of two paired binary outcomes: under the null the
  discordant pairs split as Binomial(b + c, 1/2); the two-sided p-value is twice the smaller tail,
  at most 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: the standard normal's 97.5% quantile (two-sided 95%)
Z95 = 1.959963984540054


def percentile(values: Sequence[float], q: float) -> float | None:
    """``numpy.percentile`` (linear interpolation) of ``values``; None when empty."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def percentile_rank(n: int, q: float) -> tuple[int, int, float]:
    """Where the ``q``-th percentile of ``n`` sorted values lies under linear interpolation: the
    ranks ``lo`` and ``hi`` around it and the weight ``w`` of ``hi`` (value ``x_lo + w (x_hi - x_lo)``)."""
    h = (n - 1) * q / 100.0
    lo = math.floor(h)
    return lo, min(lo + 1, n - 1), h - lo


def binomial_se(k: int, n: int) -> float | None:
    """sqrt(p (1 - p) / n) with p = k / n (divisor n); None when n = 0."""
    if n <= 0:
        return None
    p = k / n
    return math.sqrt(p * (1 - p) / n)


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of k successes in n trials: (center -+ half) / (1 + z^2/n) with
    center = p + z^2/(2n) and half = z sqrt(p(1-p)/n + z^2/(4n^2)); None when n = 0."""
    if n <= 0:
        return None
    p = k / n
    z2 = z * z
    denom = 1 + z2 / n
    center = p + z2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    lo, hi = (center - half) / denom, (center + half) / denom
    # exact at the ends (p = 0 or 1), where rounding would leave 1e-17 off
    return (0.0 if k == 0 else max(0.0, lo)), (1.0 if k == n else min(1.0, hi))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` and ``c`` discordant pairs (one run right where the
    other is wrong, and the reverse): 2 * P(X <= min(b, c)) for X ~ Binomial(b + c, 1/2), at most 1;
    1 when there is no discordant pair."""
    if b < 0 or c < 0:
        raise ValueError("discordant counts must not be negative")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def proportion(k: int, n: int, prefix: str) -> dict:
    """``{prefix: k/n, prefix_se, prefix_ci_low, prefix_ci_high}`` (Wilson 95%); values None when n = 0."""
    ci = wilson_interval(k, n)
    return {
        prefix: k / n if n else None,
        f"{prefix}_se": binomial_se(k, n),
        f"{prefix}_ci_low": ci[0] if ci else None,
        f"{prefix}_ci_high": ci[1] if ci else None,
    }


def discordant(a: list[bool], b: list[bool]) -> tuple[int, int]:
    """Paired outcomes -> (pairs where ``a`` is right and ``b`` wrong, pairs where ``b`` is right and ``a`` wrong)."""
    if len(a) != len(b):
        raise ValueError("paired outcomes of different lengths")
    return sum(bool(x) and not bool(y) for x, y in zip(a, b)), sum(bool(y) and not bool(x) for x, y in zip(a, b))
