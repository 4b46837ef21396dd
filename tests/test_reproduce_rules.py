"""The claims' rule evaluator on hand-made facts: every rule form the claims file uses, the
inconclusive case (an interval straddling the threshold), a missing figure (not comparable, never an
exception), ambiguous operands, malformed rules; and the interval helpers against hand values."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvcmas_bench.reproduce import rules
from kvcmas_bench.reproduce.rules import FAILS, HOLDS, INCONCLUSIVE, NOT_COMPARABLE, RuleError, evaluate
from kvcmas_bench.results.stats import chi2_quantile, quantile_interval, std_interval


def fact(method, value, low=None, high=None, *, figure="ttft_p50_s", workload="mmlu", point="", experiment="e", n=10):
    return {
        "experiment": experiment, "workload": workload, "method": method, "point": point, "repeat": 0,
        "figure": figure, "value": value, "low": math.nan if low is None else low,
        "high": math.nan if high is None else high, "n": n,
    }  # fmt: skip


def frame(*rows) -> pd.DataFrame:
    return pd.DataFrame(list(rows))


RATIO = {
    "form": "ratio",
    "experiment": "e",
    "figure": "ttft_p50_s",
    "a": "nonshared",
    "b": "kvcmas",
    "op": ">=",
    "value": 2.0,
}


def test_ratio_holds_when_the_whole_interval_clears_the_threshold():
    f = frame(fact("nonshared", 2.4, 2.2, 2.6), fact("kvcmas", 1.0, 0.95, 1.05))
    v = evaluate(RATIO, f)
    assert v.verdict == HOLDS
    assert v.value == pytest.approx(2.4)
    assert v.low == pytest.approx(2.2 / 1.05) and v.high == pytest.approx(2.6 / 0.95)


def test_ratio_straddling_the_threshold_is_inconclusive_never_holds():
    f = frame(fact("nonshared", 2.4, 1.8, 3.0), fact("kvcmas", 1.0, 0.9, 1.1))
    v = evaluate(RATIO, f)
    assert v.verdict == INCONCLUSIVE  # 2.4 >= 2.0, but [1.64, 3.33] straddles 2.0
    assert "straddles" in v.reason


def test_ratio_below_the_threshold_does_not_hold():
    f = frame(fact("nonshared", 1.2, 1.1, 1.3), fact("kvcmas", 1.0, 0.95, 1.05))
    assert evaluate(RATIO, f).verdict == FAILS


def test_a_figure_without_interval_is_judged_on_its_value_and_says_so():
    rule = {**RATIO, "figure": "method_state_peak_bytes", "a": "kvcomm", "value": 2.5}
    f = frame(
        fact("kvcomm", 500.0, figure="method_state_peak_bytes"), fact("kvcmas", 100.0, figure="method_state_peak_bytes")
    )
    v = evaluate(rule, f)
    assert v.verdict == HOLDS and v.value == 5.0
    assert "no interval" in v.reason


def test_an_unbounded_percentile_interval_makes_a_ratio_inconclusive():
    # too few requests for a p90 interval: the upper end is infinite, the lower 0
    f = frame(fact("nonshared", 3.0, 0.0, math.inf), fact("kvcmas", 1.0, 0.9, 1.1))
    assert evaluate(RATIO, f).verdict == INCONCLUSIVE


def test_ratio_at_most_a_bound_for_percent_lower_claims():
    rule = {**RATIO, "a": "kvcmas", "b": "graphflow", "op": "<=", "value": 0.73}
    assert evaluate(rule, frame(fact("kvcmas", 0.6, 0.58, 0.62), fact("graphflow", 1.0, 0.98, 1.02))).verdict == HOLDS
    assert evaluate(rule, frame(fact("kvcmas", 0.9, 0.88, 0.92), fact("graphflow", 1.0, 0.98, 1.02))).verdict == FAILS


def test_ratio_between_bounds():
    rule = {"form": "ratio", "experiment": "e", "figure": "ttft_p50_s", "a": {"method": "kvcmas", "point": "V20"},
            "b": {"method": "kvcmas", "point": "V5"}, "between": [0.9, 1.1]}  # fmt: skip
    f = frame(fact("kvcmas", 1.02, point="V20"), fact("kvcmas", 1.0, point="V5"))
    assert evaluate(rule, f).verdict == HOLDS
    f = frame(fact("kvcmas", 1.5, point="V20"), fact("kvcmas", 1.0, point="V5"))
    assert evaluate(rule, f).verdict == FAILS


def test_aggregate_max_over_workloads_reads_up_to_claims():
    rule = {**RATIO, "figure": "peak_mem_bytes", "a": "kvcomm", "value": 3.7, "over": "workload", "aggregate": "max"}
    f = frame(
        fact("kvcomm", 2.0, figure="peak_mem_bytes", workload="mmlu"),
        fact("kvcmas", 1.0, figure="peak_mem_bytes", workload="mmlu"),
        fact("kvcomm", 4.0, figure="peak_mem_bytes", workload="gsm8k"),
        fact("kvcmas", 1.0, figure="peak_mem_bytes", workload="gsm8k"),
    )
    v = evaluate(rule, f)
    assert v.verdict == HOLDS and v.value == 4.0 and "gsm8k" in v.reason
    v = evaluate({**rule, "aggregate": "all"}, f)
    assert v.verdict == FAILS  # mmlu's 2.0 does not reach 3.7


def paired(method, outcomes, *, experiment="e", workload="mmlu", point=""):
    return [
        {"experiment": experiment, "workload": workload, "method": method, "point": point, "repeat": 0,
         "sample_id": f"s{i}", "correct": ok}
        for i, ok in enumerate(outcomes)
    ]  # fmt: skip


MCNEMAR = {"form": "difference", "experiment": "e", "figure": "accuracy", "workload": "mmlu", "a": "kvcmas",
           "b": "kvcmas-nonchained", "op": ">", "value": 0.0, "test": "mcnemar", "alpha": 0.05}  # fmt: skip


def acc_facts(a: float, b: float):
    return frame(fact("kvcmas", a, figure="accuracy"), fact("kvcmas-nonchained", b, figure="accuracy"))


def test_difference_with_mcnemar_holds_on_a_significant_gain():
    # 10 samples right only under chaining, none the other way: p = 2 / 2^10
    a = [True] * 10 + [False] * 10
    b = [False] * 10 + [False] * 10
    pf = pd.DataFrame(paired("kvcmas", a) + paired("kvcmas-nonchained", b))
    v = evaluate(MCNEMAR, acc_facts(0.5, 0.0), pf)
    assert v.verdict == HOLDS
    assert v.p_value == pytest.approx(2 / 1024)
    assert v.value == pytest.approx(0.5) and v.n == 20


def test_difference_with_mcnemar_not_significant_is_inconclusive():
    # 3 vs 1 discordant pairs: p = 2 * (1 + 4) / 16 = 0.625
    a = [True, True, True, False, True]
    b = [False, False, False, True, True]
    pf = pd.DataFrame(paired("kvcmas", a) + paired("kvcmas-nonchained", b))
    v = evaluate(MCNEMAR, acc_facts(0.8, 0.4), pf)
    assert v.verdict == INCONCLUSIVE
    assert v.p_value == pytest.approx(0.625)


def test_difference_with_mcnemar_significant_loss_does_not_hold():
    a = [False] * 10 + [True] * 2
    b = [True] * 10 + [True] * 2
    pf = pd.DataFrame(paired("kvcmas", a) + paired("kvcmas-nonchained", b))
    assert evaluate(MCNEMAR, acc_facts(2 / 12, 1.0), pf).verdict == FAILS


def test_difference_without_paired_outcomes_is_not_comparable():
    v = evaluate(MCNEMAR, acc_facts(0.5, 0.4), pd.DataFrame())
    assert v.verdict == NOT_COMPARABLE and "paired" in v.reason


def test_difference_on_intervals():
    rule = {
        "form": "difference",
        "experiment": "e",
        "figure": "accuracy",
        "a": "kvcmas",
        "b": "kvcomm",
        "op": ">",
        "value": 0.0,
    }
    f = frame(fact("kvcmas", 0.6, 0.5, 0.7, figure="accuracy"), fact("kvcomm", 0.3, 0.2, 0.4, figure="accuracy"))
    v = evaluate(rule, f)
    assert v.verdict == HOLDS and v.low == pytest.approx(0.1) and v.high == pytest.approx(0.5)
    f = frame(fact("kvcmas", 0.6, 0.4, 0.8, figure="accuracy"), fact("kvcomm", 0.5, 0.3, 0.7, figure="accuracy"))
    assert evaluate(rule, f).verdict == INCONCLUSIVE


WITHIN = {"form": "within", "experiment": "e", "figure": "accuracy", "a": "kvcmas", "b": "kvcomm", "value": 0.02}


def test_within_holds_when_the_difference_interval_lies_inside_the_tolerance():
    f = frame(
        fact("kvcmas", 0.500, 0.495, 0.505, figure="accuracy"), fact("kvcomm", 0.502, 0.498, 0.506, figure="accuracy")
    )
    v = evaluate(WITHIN, f)
    assert v.verdict == HOLDS  # a - b in [-0.011, 0.007]


def test_within_with_wide_intervals_is_inconclusive():
    f = frame(fact("kvcmas", 0.50, 0.30, 0.70, figure="accuracy"), fact("kvcomm", 0.51, 0.31, 0.71, figure="accuracy"))
    assert evaluate(WITHIN, f).verdict == INCONCLUSIVE


def test_within_far_apart_does_not_hold():
    f = frame(fact("kvcmas", 0.30, 0.29, 0.31, figure="accuracy"), fact("kvcomm", 0.60, 0.59, 0.61, figure="accuracy"))
    assert evaluate(WITHIN, f).verdict == FAILS


def test_within_below_asks_a_to_be_second():
    rule = {**WITHIN, "below": True}
    f = frame(fact("kvcmas", 0.500, figure="accuracy"), fact("kvcomm", 0.505, figure="accuracy"))
    assert evaluate(rule, f).verdict == HOLDS
    f = frame(fact("kvcmas", 0.505, figure="accuracy"), fact("kvcomm", 0.500, figure="accuracy"))
    assert evaluate(rule, f).verdict == FAILS  # within tolerance but ahead of KVComm, not second to it


EXTREME = {"form": "extreme", "experiment": "e", "figure": "ttft_mean_s", "a": "kvcmas", "which": "lowest",
           "among": ["graphflow", "kvcomm"], "over": "workload"}  # fmt: skip


def three(workload, mine, gf, kc):
    return [
        fact("kvcmas", *mine, figure="ttft_mean_s", workload=workload),
        fact("graphflow", *gf, figure="ttft_mean_s", workload=workload),
        fact("kvcomm", *kc, figure="ttft_mean_s", workload=workload),
    ]


def test_extreme_lowest_on_every_workload_holds():
    f = frame(*three("mmlu", (1.0, 0.9, 1.1), (1.5, 1.4, 1.6), (2.0, 1.9, 2.1)),
              *three("gsm8k", (1.0, 0.9, 1.1), (1.3, 1.2, 1.4), (2.0, 1.9, 2.1)))  # fmt: skip
    v = evaluate(EXTREME, f)
    assert v.verdict == HOLDS and v.value == 2 and v.n == 2


def test_extreme_with_overlapping_intervals_is_inconclusive():
    f = frame(*three("mmlu", (1.0, 0.8, 1.2), (1.1, 0.9, 1.3), (2.0, 1.9, 2.1)))
    assert evaluate(EXTREME, f).verdict == INCONCLUSIVE


def test_extreme_beaten_clearly_does_not_hold():
    f = frame(*three("mmlu", (1.0, 0.9, 1.1), (0.5, 0.4, 0.6), (2.0, 1.9, 2.1)))
    v = evaluate(EXTREME, f)
    assert v.verdict == FAILS and "graphflow" in v.reason


def test_extreme_at_least_k_of_n_and_too_few_groups():
    rule = {**EXTREME, "which": "highest", "figure": "accuracy", "at_least": 2}
    rows = []
    for wl, mine in (("mmlu", 0.9), ("gsm8k", 0.8), ("humaneval", 0.1)):
        rows += [
            fact("kvcmas", mine, figure="accuracy", workload=wl),
            fact("kvcomm", 0.5, figure="accuracy", workload=wl),
        ]
    assert evaluate(rule, frame(*rows)).verdict == HOLDS  # best on 2 of 3
    assert evaluate({**rule, "at_least": 3}, frame(*rows)).verdict == FAILS
    v = evaluate({**rule, "at_least": 5}, frame(*rows))
    assert v.verdict == NOT_COMPARABLE and "3 of the 5" in v.reason  # two workloads never ran


def test_value_between_and_threshold_per_point():
    rule = {"form": "value", "experiment": "e", "figure": "effective_rank", "a": {},
            "point": ["pf_delta/K", "pf_delta/V"], "between": [4.0, 6.0], "over": "point"}  # fmt: skip
    f = frame(
        fact("", 5.0, figure="effective_rank", point="pf_delta/K"),
        fact("", 4.5, figure="effective_rank", point="pf_delta/V"),
    )
    assert evaluate(rule, f).verdict == HOLDS
    f = frame(
        fact("", 5.0, figure="effective_rank", point="pf_delta/K"),
        fact("", 9.8, figure="effective_rank", point="pf_delta/V"),
    )
    v = evaluate(rule, f)
    assert v.verdict == FAILS and "pf_delta/V" in v.reason
    f = frame(fact("", 5.0, 3.5, 5.5, figure="effective_rank", point="pf_delta/K"),
              fact("", 5.0, figure="effective_rank", point="pf_delta/V"))  # fmt: skip
    assert evaluate(rule, f).verdict == INCONCLUSIVE


@pytest.mark.parametrize(
    "facts",
    [pd.DataFrame(), frame(fact("kvcmas", 1.0)), frame(fact("nonshared", 1.0, figure="other"), fact("kvcmas", 1.0))],
)
def test_a_missing_figure_is_not_comparable_never_an_exception(facts):
    v = evaluate(RATIO, facts)
    assert v.verdict == NOT_COMPARABLE and v.reason


def test_an_operand_matching_two_facts_is_not_comparable():
    f = frame(fact("nonshared", 2.0), fact("nonshared", 3.0), fact("kvcmas", 1.0))
    v = evaluate({**RATIO, "over": "workload"}, f)  # both facts in the same workload: ambiguous
    assert v.verdict == NOT_COMPARABLE and "ambiguous" in v.reason


def test_a_zero_denominator_is_not_comparable():
    assert evaluate(RATIO, frame(fact("nonshared", 1.0), fact("kvcmas", 0.0))).verdict == NOT_COMPARABLE


@pytest.mark.parametrize(
    "rule,needle",
    [
        ({"form": "bigger", "a": "x"}, "form"),
        ({**RATIO, "colour": "red"}, "unknown rule key"),
        ({k: v for k, v in RATIO.items() if k != "b"}, "operand b"),
        ({**RATIO, "op": "=="}, "op"),
        ({"form": "value", "a": "x", "figure": "f"}, "either value"),
        ({"form": "value", "a": "x", "figure": "f", "between": [2, 1]}, "low <= high"),
        ({"form": "extreme", "a": "x", "figure": "f", "which": "best", "among": ["y"]}, "lowest|highest"),
        ({**MCNEMAR, "test": "t-test"}, "mcnemar"),
        ({**RATIO, "aggregate": "mean"}, "aggregate"),
    ],
)
def test_malformed_rules_are_refused(rule, needle):
    with pytest.raises(RuleError, match=needle):
        evaluate(rule, pd.DataFrame())


def test_judge_and_paired_difference_by_hand():
    est = rules.Estimate(2.5, 2.1, 2.9)
    assert rules.judge(est, lambda x: x >= 2.0) == HOLDS
    assert rules.judge(est, lambda x: x >= 2.5) == INCONCLUSIVE
    assert rules.judge(est, lambda x: x >= 3.0) == FAILS
    d, p = rules.paired_difference([True, True, False, True], [False, True, False, False])
    # b = 2 (a right, b wrong), c = 0: d = 2/4; se = sqrt(2 - 4/4) / 4 = 0.25
    assert d.value == 0.5 and d.low == pytest.approx(0.5 - 1.959963984540054 * 0.25)
    assert p == pytest.approx(0.5)  # 2 * (1/4)


def test_interval_helpers_against_tables():
    # distribution-free median interval of 20 values: order statistics 6 and 15 (Conover's table)
    assert quantile_interval(list(range(1, 21)), 50) == (6.0, 15.0)
    assert quantile_interval([1.0, 2.0, 3.0], 50) == (None, None)  # 3 values cannot bound a median at 95%
    # chi-square quantiles: k = 2 is exponential, -2 ln(1 - p); k = 10 from the table
    assert chi2_quantile(0.975, 2) == pytest.approx(-2 * math.log(0.025), rel=1e-9)
    assert chi2_quantile(0.975, 10) == pytest.approx(20.483, abs=1e-3)
    assert chi2_quantile(0.025, 10) == pytest.approx(3.247, abs=1e-3)
    lo, hi = std_interval(1.0, 3)  # sqrt(2 / 7.378), sqrt(2 / 0.0506)
    assert lo == pytest.approx(0.5207, abs=1e-4) and hi == pytest.approx(6.285, abs=1e-3)


def test_not_comparable_names_what_was_not_measured_and_what_was():
    rule = {**RATIO, "figure": "method_state_peak_bytes", "point": "shared=8192,qps=0", "a": "kvcomm"}
    f = frame(fact("kvcomm", 5.0, figure="method_state_peak_bytes", point="shared=2048,qps=0"),
              fact("kvcmas", 1.0, figure="method_state_peak_bytes", point="shared=2048,qps=0"))  # fmt: skip
    v = evaluate(rule, f)
    assert v.verdict == NOT_COMPARABLE
    assert v.reason == "point shared=8192,qps=0 not measured in e (measured: shared=2048,qps=0)"
    v = evaluate({**RATIO, "experiment": "elsewhere"}, f)
    assert v.reason == "nothing measured in elsewhere"


def test_a_method_that_corrected_nothing_is_not_comparable_not_exercised():
    starved = {**fact("kvcmas", 0.4, 0.35, 0.45), "exercised": False}
    f = frame(fact("nonshared", 2.4, 2.2, 2.6), starved)
    v = evaluate(RATIO, f)
    assert v.verdict == NOT_COMPARABLE and v.reason.startswith("not exercised: kvcmas mmlu")
    rows = three("mmlu", (1.0, 0.9, 1.1), (1.5, 1.4, 1.6), (2.0, 1.9, 2.1))
    rows[2]["exercised"] = False  # KVComm's pool never filled: the ranking would compare a fallback
    v = evaluate(EXTREME, frame(*rows))
    assert v.verdict == NOT_COMPARABLE and "not exercised: kvcomm" in v.reason


def test_exercised_reads_the_corrected_segments_of_online_methods_only():
    from kvcmas_bench.reproduce.facts import exercised

    none = pd.DataFrame({"seg_corrected": [0, 0, 0]})
    some = pd.DataFrame({"seg_corrected": [0, 2, 0]})
    assert not exercised("kvcmas", none) and exercised("kvcmas", some)
    assert not exercised("kvcomm", pd.DataFrame())
    assert exercised("cacheblend", none) is None and exercised("nonshared", none) is None  # nothing to fill
