"""results.stats against hand-computed values: binomial SE, Wilson interval, exact McNemar."""

from __future__ import annotations

import math

import pytest

from kvcmas_bench.results.stats import binomial_se, discordant, mcnemar_exact, proportion, wilson_interval


def test_binomial_se_divides_by_n():
    assert binomial_se(3, 10) == pytest.approx(math.sqrt(0.3 * 0.7 / 10))  # 0.14491...
    assert binomial_se(3, 10) == pytest.approx(0.144914, abs=1e-6)
    assert binomial_se(5, 6) == pytest.approx(0.152145, abs=1e-6)
    assert binomial_se(0, 6) == 0.0 and binomial_se(6, 6) == 0.0
    assert binomial_se(0, 0) is None


@pytest.mark.parametrize(
    "k,n,lo,hi",
    [
        # roots of (p - x)^2 = z^2 x (1 - x) / n, z = 1.95996 (solved by hand / numpy.roots)
        (5, 6, 0.4364972, 0.9699466),
        (3, 10, 0.1077913, 0.6032219),
        (4, 6, 0.2999933, 0.9032286),
        (1, 2, 0.0945312, 0.9054688),
        # at the ends: n / (n + z^2) and z^2 / (n + z^2)
        (6, 6, 6 / (6 + 1.959963984540054**2), 1.0),
        (0, 6, 0.0, 1.959963984540054**2 / (6 + 1.959963984540054**2)),
    ],
)
def test_wilson_interval(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-6)


def test_wilson_interval_edges():
    assert wilson_interval(6, 6)[1] == 1.0 and wilson_interval(0, 6)[0] == 0.0  # exact, not 1 - 1e-17
    assert wilson_interval(0, 0) is None
    # symmetric in successes and failures
    lo, hi = wilson_interval(3, 10)
    lo2, hi2 = wilson_interval(7, 10)
    assert (lo, hi) == pytest.approx((1 - hi2, 1 - lo2))


@pytest.mark.parametrize(
    "b,c,p",
    [
        (5, 0, 2 * 0.5**5),  # 0.0625
        (0, 5, 2 * 0.5**5),
        (6, 0, 2 * 0.5**6),  # 0.03125: the smallest p of 6 discordant pairs
        (10, 0, 2 / 1024),
        (2, 8, 2 * (1 + 10 + 45) / 1024),  # 2 * P(X <= 2), X ~ Bin(10, 1/2) = 0.109375
        (1, 0, 1.0),  # 2 * 0.5 = 1
        (3, 3, 1.0),
        (7, 7, 1.0),
        (0, 0, 1.0),
        (4, 5, 1.0),  # 2 * P(X <= 4), Bin(9, 1/2) = 2 * 0.5 = 1
    ],
)
def test_mcnemar_exact_hand_values(b, c, p):
    assert mcnemar_exact(b, c) == pytest.approx(p)


def test_mcnemar_exact_large_counts_and_bad_input():
    # 600 vs 400 discordant: normal approximation z = 200 / sqrt(1000) = 6.32, p ~ 2.5e-10
    p = mcnemar_exact(600, 400)
    assert 1e-10 < p < 1e-9
    assert mcnemar_exact(5000, 5000) == 1.0
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_discordant_pairs_and_proportion():
    a = [True, True, False, False, True]
    b = [True, False, True, False, False]
    assert discordant(a, b) == (2, 1)
    with pytest.raises(ValueError):
        discordant([True], [True, False])
    assert proportion(5, 6, "acc") == pytest.approx(
        {"acc": 5 / 6, "acc_se": 0.152145, "acc_ci_low": 0.4364972, "acc_ci_high": 0.9699466}, abs=1e-6
    )
    assert proportion(0, 0, "acc") == {"acc": None, "acc_se": None, "acc_ci_low": None, "acc_ci_high": None}
