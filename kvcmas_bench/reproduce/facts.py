"""The facts the claims are judged on, re-derived from each experiment's validated records.

Every run directory (a suite cell, an ablation point, a chain run) is read by
:func:`~kvcmas_bench.results.frames.load_dirs` (records checked and re-scored, figures recomputed
from them, never copied from ``summary.json``); every serve-sweep by
:func:`~kvcmas_bench.results.frames.load_sweep` (rows recomputed from the served requests); the rank
and coverage analyses from their JSON records, checked for type. One long frame comes out (columns
:data:`COLUMNS`), with a 95% interval per fact where one is defined:

- accuracy and the other estimates: their Wilson interval;
- a TTFT / E2E / latency percentile: the distribution-free order-statistic interval
  (:func:`~kvcmas_bench.results.stats.quantile_interval`) over the requests (samples) it is taken of;
- a mean of those: mean -+ 1.96 s / sqrt(n);
- ``accuracy_seed_std`` (a suite with repeats): the sample standard deviation of accuracy across
  seeds with its chi-square interval, at ``repeat`` 0, ``n`` the number of seeds;
- byte counts, rho, rank-analysis means: no interval (a deterministic count, or a mean over layers).

Points: a run directory's name without its method (``kvcmas-r32-32`` -> ``r32-32``, a suite cell ->
``""``); a sweep row ``shared=S,qps=Q``, repeated as ``shared=max,...`` / ``...,qps=max`` for the
largest length and rate the sweep served; the rank analysis ``KIND/PART``; coverage ``rho=R``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from ..errors import BenchError
from ..results.frames import load_dirs, load_sweep, read_json
from ..results.stats import mean_interval, quantile_interval, std_interval

COLUMNS = ("experiment", "workload", "method", "point", "repeat", "figure", "value", "low", "high", "n", "exercised")
PAIRED_COLUMNS = ("experiment", "workload", "method", "point", "repeat", "sample_id", "correct")
#: figure -> (frame, column, statistic): the records a timing figure's interval is computed from
_SPREAD = {
    "ttft_mean_s": ("requests", "ttft_s", "mean"),
    "ttft_p50_s": ("requests", "ttft_s", 50),
    "ttft_p90_s": ("requests", "ttft_s", 90),
    "ttft_p99_s": ("requests", "ttft_s", 99),
    "e2e_mean_s": ("requests", "e2e_s", "mean"),
    "e2e_p50_s": ("requests", "e2e_s", 50),
    "e2e_p90_s": ("requests", "e2e_s", 90),
    "e2e_p99_s": ("requests", "e2e_s", 99),
    "latency_mean_s": ("samples", "latency_s", "mean"),
    "latency_p50_s": ("samples", "latency_s", 50),
}
_REPEAT = re.compile(r"repeat-(\d+)$")


def spread(values, stat) -> tuple[float | None, float | None]:
    """The 95% interval of ``stat`` (``"mean"`` or a percentile) over ``values``; a percentile's
    unbounded end becomes 0 (low: the figures are durations) or infinity (high)."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if stat == "mean":
        ci = mean_interval(vals)
        return ci if ci else (None, None)
    lo, hi = quantile_interval(vals, stat)
    if not vals:
        return None, None
    return (0.0 if lo is None else lo), (math.inf if hi is None else hi)


def _fact(key: tuple, figure: str, value: float, low=None, high=None, n=None, ran: bool = True) -> dict:
    """One fact; ``key`` = (experiment, workload, method, point, repeat)."""
    return dict(zip(COLUMNS, (*key, figure, value, low, high, n, ran)))


def exercised(method: str, requests: pd.DataFrame) -> bool | None:
    """Whether an online correction method (anchor pools) corrected at least one shared segment;
    False: its figures measure dense fallbacks, not the method (the pool never filled). None for
    the methods without online state (nothing to fill)."""
    from ..methods import METHODS

    cls = METHODS.get(method)
    if cls is None or not getattr(cls, "learns_online", False):
        return None
    return bool(not requests.empty and "seg_corrected" in requests and requests["seg_corrected"].sum() > 0)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_facts(experiment: str, root: Path) -> tuple[list[dict], list[dict]]:
    """Facts and paired outcomes of every run directory under ``root`` (suite, ablation, chain)."""
    res = load_dirs([root])
    facts, paired = [], []
    by_cell: dict[tuple, list[float]] = {}
    for run in res.runs:
        rel = run.path.resolve().relative_to(root.resolve())
        m = _REPEAT.match(rel.parts[0]) if len(rel.parts) > 2 else None
        repeat = int(m.group(1)) if m else 0
        name = run.path.name
        point = name[len(run.method) + 1 :] if name.startswith(run.method + "-") else "" if name == run.method else name
        figs = run.figures()
        n = int(figs.get("n") or 0)
        key = (experiment, run.workload, run.method, point, repeat)
        ran = exercised(run.method, run.requests) is not False
        for fig, value in figs.items():
            if not _number(value) or fig.endswith(("_se", "_ci_low", "_ci_high")):
                continue
            low, high = figs.get(f"{fig}_ci_low"), figs.get(f"{fig}_ci_high")
            if fig in _SPREAD:
                frame, col, stat = _SPREAD[fig]
                rows = run.requests if frame == "requests" else run.samples
                if col in rows:
                    low, high = spread(rows[col].tolist(), stat)
            facts.append(_fact(key, fig, float(value), low, high, n, ran))
        if "accuracy" in figs and _number(figs["accuracy"]):
            by_cell.setdefault((experiment, run.workload, run.method, point), []).append(float(figs["accuracy"]))
        if not run.samples.empty and "correct" in run.samples:
            for sid, ok in zip(run.samples["sample_id"], run.samples["correct"]):
                paired.append(dict(zip(PAIRED_COLUMNS, (*key, sid, bool(ok)))))
    for (exp, wl, method, point), accs in by_cell.items():
        if len(accs) >= 2:
            s = float(pd.Series(accs).std(ddof=1))
            ci = std_interval(s, len(accs))
            facts.append(_fact((exp, wl, method, point, 0), "accuracy_seed_std", s, ci[0], ci[1], len(accs)))
    return facts, paired


def sweep_facts(experiment: str, root: Path) -> list[dict]:
    """Facts of one serve-sweep directory: every numeric row figure, with percentile intervals from
    the served requests of that point; ``max`` aliases for the largest length and rate."""
    sw = load_sweep(root)
    rows = sw.rows
    if rows.empty:
        return []
    top_s, top_q = rows["shared_tokens"].max(), rows["qps"].max()
    served = sw.requests
    facts = []
    for _, row in rows.iterrows():
        s, q = int(row["shared_tokens"]), float(row["qps"])
        mine = served
        if not served.empty and {"method", "shared_tokens", "qps"} <= set(served):
            mine = served[(served["method"] == row["method"]) & (served["shared_tokens"] == s) & (served["qps"] == q)]
        ran = exercised(row["method"], mine) is not False
        names = [f"shared={s},qps={q:g}"]
        if s == top_s:
            names.append(f"shared=max,qps={q:g}")
        if q == top_q:
            names.append(f"shared={s},qps=max")
        if s == top_s and q == top_q:
            names.append("shared=max,qps=max")
        for fig, value in row.items():
            if fig in ("shared_tokens", "qps") or not _number(value):
                continue
            low = high = None
            if fig in _SPREAD and _SPREAD[fig][0] == "requests" and _SPREAD[fig][1] in mine:
                low, high = spread(mine[_SPREAD[fig][1]].tolist(), _SPREAD[fig][2])
            for point in names:
                key = (experiment, "trace", row["method"], point, 0)
                facts.append(_fact(key, fig, float(value), low, high, len(mine), ran))
    return facts


def _records_of(path: Path, key: str) -> list[dict]:
    data = read_json(path)
    rows = data.get(key)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise BenchError(f"{path} is corrupt (its {key} are not a list of objects)")
    return rows


def rank_facts(experiment: str, root: Path) -> list[dict]:
    """Effective rank and kept energy per (workload, kind, part) from ``rank.json`` (a file written
    before ``energy_rN`` existed gives no energy fact: its claims are not comparable)."""
    facts = []
    for r in _records_of(root / "rank.json", "summary"):
        point = f"{r.get('kind')}/{r.get('part')}"
        wl = r.get("workload", "")
        for k, v in r.items():
            if not _number(v):
                continue
            if k == "effective_rank":
                facts.append(_fact((experiment, wl, "", point, 0), k, float(v), n=r.get("matrices")))
            elif k.startswith("energy_r"):
                facts.append(_fact((experiment, wl, "", point, 0), k, float(v), n=r.get("matrices")))
    return facts


def coverage_facts(experiment: str, root: Path) -> list[dict]:
    """Coverage per criterion and rho from every ``coverage.json`` under ``root``."""
    facts = []
    for path in sorted(root.rglob("coverage.json")):
        wl = read_json(path).get("workload", "")
        for r in _records_of(path, "rows"):
            for k in ("coverage", "relative_coverage"):
                if _number(r.get(k)) and _number(r.get("rho")):
                    key = (experiment, wl, r.get("criterion"), f"rho={float(r['rho']):g}", 0)
                    facts.append(_fact(key, k, float(r[k]), n=r.get("observations")))
    return facts


READERS = {"runs": run_facts, "sweep": sweep_facts, "rank": rank_facts, "coverage": coverage_facts}


def collect(experiments: dict[str, tuple[str, Path]]) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str]]:
    """``{name: (reader, dir)}`` -> (facts, paired outcomes, ``{name: why it could not be read}``)."""
    facts, paired, problems = [], [], {}
    for name, (reader, path) in experiments.items():
        try:
            if reader == "runs":
                f, p = run_facts(name, path)
                facts += f
                paired += p
            else:
                facts += READERS[reader](name, path)
        except BenchError as exc:
            problems[name] = str(exc)
    return pd.DataFrame(facts, columns=list(COLUMNS)), pd.DataFrame(paired, columns=list(PAIRED_COLUMNS)), problems
