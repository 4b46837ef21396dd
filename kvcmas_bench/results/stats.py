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


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(min(k, n) + 1)))


def quantile_interval(values: Sequence[float], q: float, level: float = 0.95) -> tuple[float | None, float | None]:
    """Distribution-free interval of the ``q``-th percentile from order statistics: with B ~
    Binomial(n, q/100), the lower end is the largest ``x_(l)`` (1-based) with P(B < l) <= (1 - level)/2
    and the upper end the smallest ``x_(u)`` with P(B < u) >= (1 + level)/2; an end that no order
    statistic reaches is None (unbounded: too few values for that quantile)."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        return None, None
    p, tail = q / 100.0, (1 - level) / 2
    lo = max((k for k in range(1, n + 1) if binomial_cdf(k - 1, n, p) <= tail), default=None)
    hi = min((k for k in range(1, n + 1) if binomial_cdf(k - 1, n, p) >= 1 - tail), default=None)
    return (xs[lo - 1] if lo else None), (xs[hi - 1] if hi else None)


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float] | None:
    """mean -+ z s / sqrt(n) (s with divisor n - 1); None below two values."""
    n = len(values)
    if n < 2:
        return None
    xs = np.asarray(values, dtype=float)
    half = z * float(xs.std(ddof=1)) / math.sqrt(n)
    m = float(xs.mean())
    return m - half, m + half


def _gamma_p(a: float, x: float) -> float:
    """Regularized lower incomplete gamma P(a, x) by its series (x < a + 1) or continued fraction."""
    if x <= 0:
        return 0.0
    lg = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        k = a
        while abs(term) > 1e-15 * abs(total):
            k += 1
            term *= x / k
            total += term
        return total * math.exp(lg)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c if abs(b + an / c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return 1.0 - math.exp(lg) * h


def chi2_quantile(p: float, k: int) -> float:
    """The ``p`` quantile of the chi-square distribution with ``k`` degrees of freedom (bisection on
    P(k/2, x/2))."""
    lo, hi = 0.0, max(1.0, 10.0 * k)
    while _gamma_p(k / 2, hi / 2) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if _gamma_p(k / 2, mid / 2) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def std_interval(s: float, n: int, level: float = 0.95) -> tuple[float, float] | None:
    """The chi-square interval of a standard deviation ``s`` from ``n`` values (divisor n - 1):
    [s sqrt(k / chi2_{(1+level)/2, k}), s sqrt(k / chi2_{(1-level)/2, k})] with k = n - 1."""
    if n < 2:
        return None
    k = n - 1
    return s * math.sqrt(k / chi2_quantile((1 + level) / 2, k)), s * math.sqrt(k / chi2_quantile((1 - level) / 2, k))
