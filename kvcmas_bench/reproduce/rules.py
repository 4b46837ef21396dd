"""The one evaluator of the claims' verdict rules, over a long frame of facts.

A *fact* is one figure of one experiment's result, with its uncertainty: a row of the facts frame
with columns ``experiment, workload, method, point, repeat, figure, value, low, high, n``
(:func:`kvcmas_bench.reproduce.facts.collect` builds it from validated records; ``low``/``high``
are a 95% interval, NaN when the figure has none). Paired per-sample outcomes for McNemar tests come
in a second frame with ``experiment, workload, method, point, repeat, sample_id, correct``.

A rule is a mapping (a TOML table of ``claims.toml``) with a ``form`` and its operands. Operands
select facts: the rule's own ``experiment``, ``figure``, ``workload``, ``point`` and ``repeat`` are
defaults that ``a`` and ``b`` (tables, or a bare method name) override. Forms:

- ``value``: ``a op value``, or ``a`` in ``between = [low, high]``;
- ``ratio``: ``a / b op value`` (interval: ``[a.low / b.high, a.high / b.low]``);
- ``difference``: ``a - b op value``; ``test = "mcnemar"`` pairs the samples and asks for p <
  ``alpha`` (default 0.05) on top of the sign; otherwise the interval of the difference decides
  (``[a.low - b.high, a.high - b.low]``);
- ``within``: ``|a - b| <= value``; ``below = true`` also asks ``a <= b`` ("second to b");
- ``extreme``: ``a``'s method has the ``lowest``/``highest`` figure among ``among`` (methods) in
  each group of ``over`` (``workload`` or ``point``); ``at_least = k`` groups (default: every group).

When an operand selects several facts (several workloads, points or seeds), the rule is judged per
group of the ``over`` column and ``aggregate`` combines the groups: ``all`` (default; holds only if
every group holds), ``max`` / ``min`` (the group with the largest / smallest value decides: "up to
3.7x"), ``at_least`` (``extreme``'s count).

Verdicts: ``holds``, ``does not hold``, ``inconclusive`` (the interval straddles the threshold, or a
test is not significant) and ``not comparable`` (a figure is missing); never an exception on data.
A verdict is never ``holds`` when the uncertainty straddles the threshold. A figure without an
interval (a deterministic byte count, a median of one run) is judged on its value and says so. A fact
of an online correction method that corrected no segment (``exercised`` false: its pool never filled)
makes the verdict "not comparable", reason "not exercised".
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from ..results.stats import Z95, mcnemar_exact

HOLDS, FAILS, INCONCLUSIVE, NOT_COMPARABLE = "holds", "does not hold", "inconclusive", "not comparable"
VERDICTS = (HOLDS, FAILS, INCONCLUSIVE, NOT_COMPARABLE)
FORMS = ("value", "ratio", "difference", "within", "extreme")
OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
SELECTORS = ("experiment", "workload", "method", "point", "repeat", "figure")
AGGREGATES = ("all", "max", "min")
RULE_KEYS = {
    "form", "a", "b", "op", "value", "between", "test", "alpha", "below", "among", "which", "over",
    "at_least", "aggregate", "scale", *SELECTORS,
}  # fmt: skip


class RuleError(ValueError):
    """A rule that is malformed (a defect of the claims file, caught by its tests)."""


@dataclass
class Verdict:
    """One claim's outcome: the verdict, our value with its interval, and why."""

    verdict: str
    value: float | None = None
    low: float | None = None
    high: float | None = None
    n: int | None = None
    reason: str = ""
    #: the facts the verdict read, as ``(label, value)``
    used: list[tuple[str, float | None]] = field(default_factory=list)
    p_value: float | None = None


@dataclass(frozen=True)
class Estimate:
    """A number with a 95% interval (``low``/``high`` None: no interval known)."""

    value: float
    low: float | None = None
    high: float | None = None
    n: int | None = None

    @property
    def bounded(self) -> bool:
        return self.low is not None and self.high is not None


def check_rule(rule: Mapping) -> None:
    """Raise :class:`RuleError` for a malformed rule (unknown form, key, operator or aggregate)."""
    form = rule.get("form")
    if form not in FORMS:
        raise RuleError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    unknown = sorted(set(rule) - RULE_KEYS)
    if unknown:
        raise RuleError(f"unknown rule key(s) {', '.join(unknown)}")
    if "a" not in rule:
        raise RuleError("a rule needs operand a")
    if form in ("ratio", "difference", "within") and "b" not in rule:
        raise RuleError(f"form {form} needs operand b")
    if form in ("value", "ratio", "difference") and ("between" in rule) == ("value" in rule):
        raise RuleError(f"form {form} needs either value (with op) or between")
    if form in ("value", "ratio", "difference") and "value" in rule and rule.get("op") not in OPS:
        raise RuleError(f"op must be one of {', '.join(OPS)}, got {rule.get('op')!r}")
    if form == "within" and not isinstance(rule.get("value"), (int, float)):
        raise RuleError("form within needs a numeric value (the tolerance)")
    if form == "extreme":
        if rule.get("which") not in ("lowest", "highest") or not rule.get("among"):
            raise RuleError("form extreme needs which = lowest|highest and among = [methods]")
    if rule.get("test") not in (None, "mcnemar"):
        raise RuleError(f"test must be mcnemar, got {rule.get('test')!r}")
    if rule.get("aggregate", "all") not in AGGREGATES:
        raise RuleError(f"aggregate must be one of {', '.join(AGGREGATES)}")
    if "between" in rule:
        lo, hi = rule["between"]
        if not lo <= hi:
            raise RuleError("between = [low, high] needs low <= high")


def operand(rule: Mapping, name: str) -> dict:
    """The selector of operand ``name``: the rule's defaults overridden by the operand's own keys."""
    own = rule.get(name, {})
    own = {"method": own} if isinstance(own, str) else dict(own)
    base = {k: rule[k] for k in SELECTORS if k in rule}
    return {**base, **own}


def select(facts: pd.DataFrame, sel: Mapping) -> pd.DataFrame:
    """The facts matching every key of ``sel`` (a list value matches any of its items)."""
    if facts is None or facts.empty:
        return pd.DataFrame(columns=[*SELECTORS, "value", "low", "high", "n"])
    mask = pd.Series(True, index=facts.index)
    for k, v in sel.items():
        if k not in facts:
            return facts.iloc[0:0]
        values = v if isinstance(v, (list, tuple)) else [v]
        mask &= facts[k].isin(values)
    return facts[mask]


def estimate(row: pd.Series) -> Estimate:
    def num(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)

    n = row.get("n")
    return Estimate(float(row["value"]), num(row.get("low")), num(row.get("high")), None if num(n) is None else int(n))


def judge(est: Estimate, holds) -> str:
    """``holds``/``does not hold`` when both interval ends (or the bare value) agree, else inconclusive."""
    if not est.bounded:
        return HOLDS if holds(est.value) else FAILS
    lo, hi = holds(est.low), holds(est.high)
    if lo and hi:
        return HOLDS
    if not lo and not hi:
        return FAILS
    return INCONCLUSIVE


def ratio(a: Estimate, b: Estimate) -> Estimate | None:
    """``a / b`` with the interval of the quotient of two positive intervals (None: b is 0)."""
    if b.value == 0:
        return None
    value = a.value / b.value
    if not (a.bounded and b.bounded) or a.low < 0 or b.low < 0:
        return Estimate(value, n=a.n)
    high = math.inf if b.low == 0 else a.high / b.low
    return Estimate(value, a.low / b.high if b.high else math.inf, high, a.n)


def difference(a: Estimate, b: Estimate) -> Estimate:
    """``a - b`` with the interval ``[a.low - b.high, a.high - b.low]`` (no interval if either has none)."""
    if not (a.bounded and b.bounded):
        return Estimate(a.value - b.value, n=a.n)
    return Estimate(a.value - b.value, a.low - b.high, a.high - b.low, a.n)


def paired_difference(a: list[bool], b: list[bool]) -> tuple[Estimate, float]:
    """Accuracy difference of paired outcomes, its 95% Wald interval
    (``sqrt(b + c - (b - c)^2 / n) / n``) and the exact McNemar p-value."""
    n = len(a)
    bc = sum(x and not y for x, y in zip(a, b))
    cb = sum(y and not x for x, y in zip(a, b))
    d = (bc - cb) / n
    se = math.sqrt(max(bc + cb - (bc - cb) ** 2 / n, 0.0)) / n
    return Estimate(d, d - Z95 * se, d + Z95 * se, n), mcnemar_exact(bc, cb)


def _label(sel: Mapping) -> str:
    return " ".join(str(sel[k]) for k in ("method", "workload", "point") if sel.get(k) not in (None, ""))


def _groups(rows: pd.DataFrame, over: str | None) -> dict:
    if over is None or rows.empty:
        return {None: rows}
    return {k: g for k, g in rows.groupby(over, sort=False)}


def evaluate(rule: Mapping, facts: pd.DataFrame, paired: pd.DataFrame | None = None) -> Verdict:
    """Judge ``rule`` on ``facts`` (and ``paired`` outcomes for McNemar); see the module docstring."""
    check_rule(rule)
    form = rule["form"]
    if form == "extreme":
        return _extreme(rule, facts)
    sa = operand(rule, "a")
    a_rows = select(facts, sa)
    if a_rows.empty:
        return Verdict(NOT_COMPARABLE, reason=missing(facts, sa))
    over = rule.get("over") or _varying(a_rows)
    outcomes = []
    for key, ga in _groups(a_rows, over).items():
        v = _one(rule, form, ga, facts, paired, over, key)
        v.used.insert(0, (f"{_label(sa)}{'' if key is None else f' [{key}]'}", v.value))
        outcomes.append((key, v))
    return _aggregate(rule, outcomes, over)


def _varying(rows: pd.DataFrame) -> str | None:
    """The one selector column that varies among an operand's rows (it becomes ``over``)."""
    varying = [k for k in ("workload", "point", "repeat") if k in rows and rows[k].nunique() > 1]
    return varying[0] if len(varying) == 1 else (varying[0] if varying else None)


def _one(rule, form, ga: pd.DataFrame, facts, paired, over, key) -> Verdict:
    if len(ga) > 1:
        return Verdict(
            NOT_COMPARABLE, reason=f"{len(ga)} facts match one operand ({_dupes(ga)}); the rule is ambiguous"
        )
    if not _ran(ga.iloc[0]):
        return Verdict(NOT_COMPARABLE, reason=_not_exercised(ga.iloc[0]))
    a = estimate(ga.iloc[0])
    if form == "value":
        return _value(rule, a)
    sb = operand(rule, "b")
    own_b = rule["b"] if isinstance(rule["b"], Mapping) else {}
    if key is not None and over not in own_b:
        sb[over] = key  # b is read in the same group as a
    gb = select(facts, sb)
    if gb.empty:
        return Verdict(NOT_COMPARABLE, reason=missing(facts, sb))
    if len(gb) > 1:
        return Verdict(NOT_COMPARABLE, reason=f"{len(gb)} facts match operand b ({_dupes(gb)}); the rule is ambiguous")
    if not _ran(gb.iloc[0]):
        return Verdict(NOT_COMPARABLE, reason=_not_exercised(gb.iloc[0]))
    b = estimate(gb.iloc[0])
    used = [(_label(sb), b.value)]
    if form == "ratio":
        est = ratio(a, b)
        if est is None:
            return Verdict(NOT_COMPARABLE, reason="the denominator is 0", used=used)
        return _threshold(rule, est, used, "ratio")
    if form == "difference":
        if rule.get("test") == "mcnemar":
            return _mcnemar(rule, operand(rule, "a") | ({over: key} if key is not None else {}), sb, paired, used)
        return _threshold(rule, difference(a, b), used, "difference")
    tol = float(rule["value"])
    d = difference(a, b)
    bound = max(abs(d.low), abs(d.high)) if d.bounded else abs(d.value)
    v = judge(d, lambda x: abs(x) <= tol)
    if d.bounded and v == FAILS and d.low < tol and d.high > -tol:
        v = INCONCLUSIVE  # the interval reaches into [-tol, tol] without lying inside it
    if rule.get("below") and v != FAILS:
        side = judge(d, lambda x: x <= 0)
        v = FAILS if side == FAILS else INCONCLUSIVE if side == INCONCLUSIVE and v == HOLDS else v
    reason = f"|a - b| = {abs(d.value):.4g}, at most {bound:.4g} within the interval, tolerance {tol:g}"
    return Verdict(v, d.value, d.low, d.high, d.n, reason, used)


def _ran(row: pd.Series) -> bool:
    """The fact measures its method (facts without the ``exercised`` column always do)."""
    v = row.get("exercised", True)
    return True if v is None or (isinstance(v, float) and math.isnan(v)) else bool(v)


def _not_exercised(row: pd.Series) -> str:
    where = " ".join(str(row[k]) for k in ("method", "workload", "point") if str(row.get(k, "")))
    return (
        f"not exercised: {where} corrected no shared segment (its anchor pool never filled; every "
        "segment fell back densely), so its figures measure the fallback, not the method; add --warmup"
    )


def missing(facts: pd.DataFrame, sel: Mapping) -> str:
    """Why ``sel`` matches no fact: the first selector whose value was not measured, with the values
    that were (``point shared=8192,qps=0 not measured in memory (measured: shared=2048,qps=0)``)."""
    where = f"in {sel.get('experiment')}"
    if facts is None or facts.empty or select(facts, {"experiment": sel.get("experiment")}).empty:
        return f"nothing measured {where}"
    for key in ("point", "workload", "method", "figure"):
        if key not in sel:
            continue
        rest = select(facts, {k: v for k, v in sel.items() if k != key})
        if not rest.empty:
            wanted = sel[key] if not isinstance(sel[key], (list, tuple)) else ", ".join(map(str, sel[key]))
            seen = ", ".join(sorted({str(x) for x in rest[key]})[:8]) or "none"
            return f"{key} {wanted or '(none)'} not measured {where} (measured: {seen})"
    return f"no {sel.get('figure')} for {_label(sel) or 'the operand'} {where}"


def _dupes(rows: pd.DataFrame) -> str:
    cols = [c for c in ("workload", "method", "point", "repeat") if c in rows and rows[c].nunique() > 1]
    return ", ".join(cols) or "identical selectors"


def _value(rule, a: Estimate) -> Verdict:
    return _threshold(rule, a, [], "")


def _threshold(rule, est: Estimate, used, what: str) -> Verdict:
    """``est op value``, or ``est`` in ``between``: judged on the interval's ends."""
    if "between" in rule:
        lo, hi = (float(x) for x in rule["between"])
        v = judge(est, lambda x: lo <= x <= hi)
        if est.bounded and v == FAILS and est.low <= hi and est.high >= lo:
            v = INCONCLUSIVE  # the interval reaches into [lo, hi] without lying inside it
        why = _why(v, est, f"{what} in [{lo:g}, {hi:g}]".strip())
        return Verdict(v, est.value, est.low, est.high, est.n, why, used)
    op, t = rule["op"], float(rule["value"])
    v = judge(est, lambda x: OPS[op](x, t))
    return Verdict(v, est.value, est.low, est.high, est.n, _why(v, est, f"{what} {op} {t:g}".strip()), used)


def _why(v: str, est: Estimate, wanted: str) -> str:
    shown = f"{est.value:.4g}" + (f" [{est.low:.4g}, {est.high:.4g}]" if est.bounded else "")
    if v == INCONCLUSIVE:
        return f"{shown}: the 95% interval straddles {wanted}"
    extra = "" if est.bounded else " (no interval: judged on the value alone)"
    verb = ("is" if v == HOLDS else "is not") if wanted.startswith(("in ", "ratio", "difference")) else ""
    verb = verb or ("satisfies" if v == HOLDS else "fails")
    return f"{shown} {verb} {wanted}{extra}"


def _mcnemar(rule, sa: Mapping, sb: Mapping, paired: pd.DataFrame | None, used) -> Verdict:
    keep = ("experiment", "workload", "method", "point", "repeat")
    pa = select(paired, {k: v for k, v in sa.items() if k in keep})
    pb = select(paired, {k: v for k, v in sb.items() if k in keep})
    if pa.empty or pb.empty:
        return Verdict(NOT_COMPARABLE, reason="no paired per-sample outcomes for the McNemar test", used=used)
    m = pa[["sample_id", "correct"]].merge(pb[["sample_id", "correct"]], on="sample_id", suffixes=("_a", "_b"))
    if m.empty:
        return Verdict(NOT_COMPARABLE, reason="the two runs share no sample", used=used)
    est, p = paired_difference(m["correct_a"].astype(bool).tolist(), m["correct_b"].astype(bool).tolist())
    op, t, alpha = rule["op"], float(rule["value"]), float(rule.get("alpha", 0.05))
    right_side = OPS[op](est.value, t)
    if p < alpha:
        v = HOLDS if right_side else FAILS
        why = f"difference {est.value:+.4g} on {est.n} paired samples, McNemar p = {p:.3g} < {alpha:g}"
    else:
        v = INCONCLUSIVE
        why = f"difference {est.value:+.4g} on {est.n} paired samples, McNemar p = {p:.3g} (not below {alpha:g})"
    return Verdict(v, est.value, est.low, est.high, est.n, why, used, p_value=p)


def _aggregate(rule, outcomes: list[tuple], over) -> Verdict:
    if len(outcomes) == 1:
        return outcomes[0][1]
    agg = rule.get("aggregate", "all")
    judged = [(k, v) for k, v in outcomes if v.verdict != NOT_COMPARABLE]
    used = [u for _, v in outcomes for u in v.used]
    if agg in ("max", "min") and judged:
        pick = (max if agg == "max" else min)(judged, key=lambda kv: kv[1].value)
        k, v = pick
        return Verdict(v.verdict, v.value, v.low, v.high, v.n, f"{over} {k} ({agg}): {v.reason}", used, v.p_value)
    verdicts = [v.verdict for _, v in outcomes]
    parts = "; ".join(f"{over} {k}: {v.verdict} ({v.reason})" for k, v in outcomes)
    if FAILS in verdicts:
        final = FAILS
    elif NOT_COMPARABLE in verdicts:
        final = NOT_COMPARABLE
    elif INCONCLUSIVE in verdicts:
        final = INCONCLUSIVE
    else:
        final = HOLDS
    worst = next((v for _, v in outcomes if v.verdict == final), outcomes[0][1])
    return Verdict(final, worst.value, worst.low, worst.high, worst.n, parts, used, worst.p_value)


def _extreme(rule, facts: pd.DataFrame) -> Verdict:
    sa = operand(rule, "a")
    me = sa.get("method")
    sel = {k: v for k, v in sa.items() if k != "method"} | {"method": [me, *rule["among"]]}
    rows = select(facts, sel)
    over = rule.get("over", "workload")
    if rows.empty or me not in set(rows["method"]):
        return Verdict(NOT_COMPARABLE, reason=missing(facts, {**sel, "method": me}))
    results = [(key, *_rank_group(g, me, rule["which"])) for key, g in _groups(rows, over).items()]
    judged = [r for r in results if r[1] != NOT_COMPARABLE]
    need = int(rule.get("at_least", len(results)))
    n_hold = sum(r[1] == HOLDS for r in judged)
    n_open = sum(r[1] == INCONCLUSIVE for r in judged)
    detail = "; ".join(f"{over} {k}: {v} ({why})" for k, v, why in results)
    if need > len(judged):
        final = NOT_COMPARABLE
        detail = f"{len(judged)} of the {need} {over}s needed were measured; {detail}"
    elif n_hold >= need:
        final = HOLDS
    elif n_hold + n_open >= need:
        final = INCONCLUSIVE
    else:
        final = FAILS
    why = f"{n_hold} of {len(judged)} {over}s ({need} needed): {detail}"
    return Verdict(final, float(n_hold), n=len(judged), reason=why)


def _rank_group(g: pd.DataFrame, me: str, which: str) -> tuple[str, str]:
    """Is ``me`` the ``which`` (lowest/highest) of one group's facts, with intervals separating it?"""
    mine, others = g[g["method"] == me], g[g["method"] != me]
    if len(mine) != 1 or others.empty:
        return NOT_COMPARABLE, f"{me} {'missing' if mine.empty else 'ambiguous'} or no rival"
    bad = [r for _, r in g.iterrows() if not _ran(r)]
    if bad:
        return NOT_COMPARABLE, _not_exercised(bad[0])
    lowest = which == "lowest"
    a = estimate(mine.iloc[0])
    best, sure, beaten_by = True, True, []
    for _, r in others.iterrows():
        o = estimate(r)
        better = a.value < o.value if lowest else a.value > o.value
        best &= better
        if not better:
            beaten_by.append(str(r["method"]))
        if a.bounded and o.bounded:
            separated = a.high < o.low if lowest else a.low > o.high
            against = o.high < a.low if lowest else o.low > a.high
            sure &= separated if better else against
    if best and sure:
        return HOLDS, f"{me} {which}"
    if not best and sure:
        return FAILS, f"{', '.join(beaten_by)} {'lower' if lowest else 'higher'}"
    return INCONCLUSIVE, f"{me} {'best' if best else 'behind ' + ', '.join(beaten_by)} but the intervals overlap"
