"""The ``compare`` job: a candidate run, suite or sweep directory against a baseline, for CI.

Runs are matched by workload and method (by method options, then by seed, when a side has several
runs of a method). Inputs are **unusable** (exit 2) when a directory is missing or corrupt, when a
baseline run has no counterpart, or when a pair is incomparable: a different model, seed,
sample set or workload setting (token budgets, topology, dtype, ...); sweeps: a different model,
seed or traces.

Checks per matched pair (exit 1 when one fails):

- deterministic metrics (accuracy, agreement with NonShared, first-token agreement, rho, method
  state bytes) against thresholds, with no noise allowance: ``--max-accuracy-drop``,
  ``--max-agreement-drop``, ``--max-rho-drop``, ``--max-memory-increase`` (default: no drop / 10%);
- with ``--significance ALPHA``, an accuracy drop beyond ``--max-accuracy-drop`` counts only when
  it is significant: the exact McNemar test (two-sided binomial test with p = 1/2 on the samples
  exactly one side gets right) gives p < ALPHA. The samples always pair up: a pair with different
  sample sets is refused above as incomparable, so no unpaired (two-proportion) test is needed;
- timings (TTFT; sweeps: TTFT p50/p90) and the measured peak memory as ratios candidate/baseline
  with a noise allowance: the candidate may reach ``(baseline + allowed) * (1 + noise)``; skipped
  when the hardware differs (device, GPU, CPU count) or with ``--no-timings``.

Where the configs also match (method options, fidelity, device, calibration samples), the
deterministic records are compared value by value (predictions, first tokens, outputs, token
counts, segment statuses; fidelity floats within 1e-3 relative): the differences are listed, and
with ``--exact`` any difference is a regression. Greedy decoding is deterministic on one machine
and torch build; on another CPU a near-tie can flip a token, which ``--exact`` reports plainly.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import BenchError
from ..report.columns import cell
from ..report.tables import table1
from ..results import figures
from ..results.frames import SETTING_KEYS, Results, Run, Sweep, dir_kind, load_dirs, load_sweep, read_jsonl
from ..results.stats import discordant, mcnemar_exact

#: config keys that must also match for the value-by-value (exact) comparison of a run pair
EXACT_KEYS = ("method_config", "fidelity", "device", "target_reuse", "calibration_samples")
EXACT_SWEEP_KEYS = ("method_configs", "dtype", "device", "method_args", "ignore_eos", "warmup")
INCOMPARABLE_SWEEP_KEYS = ("model", "seed", "traces_sha256", "num_trajectories", "burstiness")
#: request fields that greedy decoding determines exactly
EXACT_FIELDS = (
    "first_token_id",
    "output",
    "output_tokens",
    "prompt_tokens",
    "prefilled_tokens",
    "reused_tokens",
    "eligible_tokens",
    "reference_tokens",
    "recomputed_token_layers",
    "seg_statuses",
    "top1_agree",
    "kv_bytes",
    "shared_store_bytes",
    "method_state_bytes",
)
FLOAT_FIELDS = ("kv_rel_error", "first_token_kl")
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9}


@dataclass(frozen=True)
class Threshold:
    """An allowed change: ``value`` absolute (in the metric's unit) or relative to the baseline."""

    value: float
    relative: bool = False

    def allowed(self, base: float) -> float:
        return self.value * abs(base) if self.relative else self.value

    def __str__(self) -> str:
        return f"{self.value * 100:g}%" if self.relative else f"{self.value:g}"


def parse_threshold(flag: str, text: str, byte_units: bool = False) -> Threshold:
    """``5%`` (relative) or a number (absolute; with ``byte_units`` also ``64MiB``, ``1GB``)."""
    t = str(text).strip().lower()
    rel = t.endswith("%")
    m = re.fullmatch(r"([0-9.eE+-]+)\s*([a-z]*)", t[:-1] if rel else t)
    try:
        if m is None or (m.group(2) and (rel or not byte_units or m.group(2) not in _UNITS)):
            raise ValueError
        v = float(m.group(1)) * (1 if rel else _UNITS[m.group(2)])
    except ValueError:
        unit = ", or bytes such as 64MiB" if byte_units else ""
        raise BenchError(f"{flag} takes a number or a percentage such as 5%{unit}; got {text!r}") from None
    if math.isnan(v) or v < 0:
        raise BenchError(f"{flag} must not be negative, got {text!r}")
    return Threshold(v / 100 if rel else v, rel)


@dataclass
class Limits:
    accuracy_drop: Threshold = Threshold(0.0)
    agreement_drop: Threshold = Threshold(0.0)
    rho_drop: Threshold = Threshold(0.0)
    ttft_increase: Threshold = Threshold(0.10, True)
    memory_increase: Threshold = Threshold(0.10, True)
    #: relative noise allowance of timings and measured peak memory
    noise: float = 0.25
    timings: bool = True
    exact: bool = False
    #: with a level ALPHA: an accuracy drop counts only when the exact McNemar p is below it
    significance: float | None = None

    def validate(self) -> None:
        a = self.significance
        if a is not None and (math.isnan(a) or not 0 < a < 1):
            raise BenchError(f"--significance takes a level between 0 and 1 (such as 0.05); got {a!r}")


@dataclass
class Check:
    scope: str
    metric: str
    baseline: float | None
    candidate: float | None
    allowed: str
    status: str  # "ok", "FAIL" or "skipped"
    kind: str = "acc"  # cell format of the values
    note: str = ""

    @property
    def change(self) -> str:
        if self.baseline is None or self.candidate is None:
            return "-"
        if self.kind in ("s", "MiB") and self.baseline:
            return f"x{self.candidate / self.baseline:.3g}"
        d = self.candidate - self.baseline
        return f"{d:+.3g}" if self.kind != "MiB" else f"{d / 2**20:+.1f} MiB"

    def line(self) -> str:
        unit = {"s": " s", "MiB": " MiB"}.get(self.kind, "")
        b, c = cell(self.baseline, self.kind), cell(self.candidate, self.kind)
        note = f"; {self.note}" if self.note and self.status != "skipped" else ""
        return f"{self.scope} {self.metric} {b} -> {c}{unit} ({self.change}; allowed: {self.allowed}{note})"


@dataclass
class Comparison:
    baseline: str
    candidate: str
    kind: str
    pairs: int = 0
    checks: list[Check] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exact: bool = False

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    @property
    def regressed(self) -> bool:
        return bool(self.failures) or (self.exact and bool(self.differences))

    def verdict(self) -> str:
        """One line: PASS/FAIL, what failed, and what was compared."""
        what = f"({self.pairs} {self.kind} pairs; baseline {self.baseline}, candidate {self.candidate})"
        if not self.regressed:
            same = "deterministic values identical" if not self.differences else "deterministic values differ"
            checked = sum(c.status == "ok" for c in self.checks)
            return f"PASS: {checked} checks within limits, {same} {what}"
        items = [c.line() for c in self.failures]
        counts = [f"{len(self.failures)} failed check{'s' if len(self.failures) != 1 else ''}"] if self.failures else []
        if self.exact and self.differences:
            items.append(f"first deterministic difference: {self.differences[0]}")
            counts.append(
                f"{len(self.differences)} deterministic difference{'s' if len(self.differences) != 1 else ''}"
            )
        shown = "; ".join(items[:3]) + (f"; and {len(items) - 3} more" if len(items) > 3 else "")
        return f"FAIL ({', '.join(counts)}): {shown} {what}"


# ---- checks ---------------------------------------------------------------------------------------
def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def drop_check(scope: str, metric: str, b, c, thr: Threshold, kind: str = "acc") -> Check:
    """Fails when the candidate is lower than the baseline by more than ``thr`` (no noise)."""
    b, c = _num(b), _num(c)
    if b is None or c is None:
        return Check(scope, metric, b, c, f"drop <= {thr}", "skipped", kind, "missing on one side")
    ok = b - c <= thr.allowed(b) + 1e-12
    return Check(scope, metric, b, c, f"drop <= {thr}", "ok" if ok else "FAIL", kind)


def increase_check(scope: str, metric: str, b, c, thr: Threshold, noise: float, kind: str) -> Check:
    """Fails when the candidate exceeds ``(baseline + allowed) * (1 + noise)``."""
    b, c = _num(b), _num(c)
    text = f"+{thr}" + (f" (+{noise * 100:g}% noise)" if noise else "")
    if b is None or c is None:
        return Check(scope, metric, b, c, text, "skipped", kind, "missing on one side")
    ok = c <= (b + thr.allowed(b)) * (1 + noise) + 1e-12
    return Check(scope, metric, b, c, text, "ok" if ok else "FAIL", kind)


def significance_check(check: Check, b: Run, c: Run, alpha: float | None) -> Check:
    """An accuracy check that failed stands only when the exact McNemar test on the paired samples
    gives p < ``alpha``; otherwise it passes, the p-value in its note (``alpha`` None: unchanged)."""
    if alpha is None or check.status == "skipped":
        return check
    ids = sorted(b.sample_ids & c.sample_ids)
    sb, sc = b.samples.set_index("sample_id")["correct"], c.samples.set_index("sample_id")["correct"]
    worse, better = discordant([bool(sb[i]) for i in ids], [bool(sc[i]) for i in ids])
    p = mcnemar_exact(worse, better)
    check.allowed += f" unless McNemar p >= {alpha:g}"
    check.note = f"McNemar p = {p:.3g} (of {len(ids)} paired samples, {worse} lost, {better} gained)"
    if check.status == "FAIL" and p >= alpha:
        check.status = "ok"
        check.note = "not significant: " + check.note
    return check


def hardware(config: dict) -> tuple:
    hw = config.get("hardware") or {}
    return (config.get("device"), hw.get("gpu"), hw.get("cpu_count"))


def figure_check(scope: str, fig, b, c, lim: Limits, timings: bool) -> Check | None:
    """The check of one figure (its :class:`~kvcmas_bench.results.figures.CheckRule`) on a baseline and
    a candidate value; None for a timing check when timings are not compared."""
    rule = fig.check
    if rule.timing and not timings:
        return None
    thr = getattr(lim, rule.limit)
    kind = "acc" if fig.kind in ("est", "rho") else fig.kind
    if rule.kind == "drop":
        return drop_check(scope, rule.label, b, c, thr, kind)
    return increase_check(scope, rule.label, b, c, thr, lim.noise if rule.timing else 0, kind)


def run_checks(scope: str, b: dict, c: dict, lim: Limits, timings: bool) -> list[Check]:
    """The threshold checks of one matched run pair (``b``, ``c``: their Table 1 rows), one per
    figure with a run-level check rule, in their order."""
    out = []
    for fig in figures.checked("run"):
        if fig.check.skip_reference and (_num(b.get(fig.name)) is None or b.get("method") == "nonshared"):
            continue  # NonShared against itself: 1 by construction
        check = figure_check(scope, fig, b.get(fig.name), c.get(fig.name), lim, timings)
        if check is not None:
            out.append(check)
    return out


# ---- runs ----------------------------------------------------------------------------------------
def match_runs(base: list[Run], cand: list[Run]) -> list[tuple[Run, Run]]:
    """Baseline runs paired with candidate runs (workload, method; method options when a side has
    several runs of a method); a baseline run without a counterpart is an error."""
    pairs = []
    for b in base:
        same = [c for c in cand if (c.workload, c.method) == (b.workload, b.method)]
        twins = [r for r in base if (r.workload, r.method) == (b.workload, b.method)]
        if len(same) != 1 or len(twins) != 1:
            same = [c for c in same if c.config.get("method_config") == b.config.get("method_config")]
        if len(same) > 1:  # repeats of one configuration (suite --repeats): told apart by the seed
            same = [c for c in same if c.config.get("seed") == b.config.get("seed")]
        if len(same) != 1:
            what = "no run" if not same else "several runs"
            raise BenchError(f"incomparable: the candidate has {what} of {b.workload}/{b.label} (baseline {b.path})")
        pairs.append((b, same[0]))
    return pairs


def check_comparable(b: Run, c: Run) -> None:
    """Different model, seed, samples or workload settings: one plain line, exit 2."""
    for key in ("model", "seed", *[k for k in SETTING_KEYS if k not in ("model", "seed")]):
        if b.config.get(key) != c.config.get(key):
            raise BenchError(
                f"incomparable: {b.workload}/{b.label} was run with a different {key} "
                f"(baseline {b.config.get(key)!r}, candidate {c.config.get(key)!r})"
            )
    if b.sample_ids != c.sample_ids:
        common = len(b.sample_ids & c.sample_ids)
        raise BenchError(
            f"incomparable: {b.workload}/{b.label} evaluated different samples (baseline {len(b.sample_ids)}, "
            f"candidate {len(c.sample_ids)}, {common} in common)"
        )


def side_dirs(arg: str) -> list[str]:
    """One side of a comparison: a directory, or a sharded suite's shard directories given
    comma-separated (``a/shard-1,a/shard-2``)."""
    if "," not in arg or Path(arg).exists():
        return [arg]
    return [p for p in (x.strip() for x in arg.split(",")) if p]


def _load_runs(path: str, side: str) -> Results:
    res = load_dirs(side_dirs(path))
    if not res.runs:
        raise BenchError(f"the {side} {path} holds no finished runs")
    return res


def compare_runs(base_dir: str, cand_dir: str, lim: Limits) -> Comparison:
    base, cand = _load_runs(base_dir, "baseline"), _load_runs(cand_dir, "candidate")
    pairs = match_runs(base.runs, cand.runs)
    for b, c in pairs:
        check_comparable(b, c)
    # every run over all its own samples: the pairs are compared sample for sample (same sample sets)
    tb, tc = table1(base, common=False).set_index("run_id"), table1(cand, common=False).set_index("run_id")
    cmp = Comparison(base_dir, cand_dir, "run", len(pairs), exact=lim.exact)
    extra = {c.run_id for c in cand.runs} - {c.run_id for _, c in pairs}
    if extra:
        cmp.notes.append(f"candidate runs without a baseline (not compared): {', '.join(sorted(extra))}")
    for b, c in pairs:
        scope = f"{b.workload}/{b.label}"
        same_hw = hardware(b.config) == hardware(c.config)
        checks = run_checks(scope, tb.loc[b.run_id].to_dict(), tc.loc[c.run_id].to_dict(), lim, lim.timings and same_hw)
        checks[0] = significance_check(checks[0], b, c, lim.significance)  # the accuracy check
        if checks[0].note.startswith("not significant"):
            cmp.notes.append(f"{scope}: accuracy {checks[0].change}, {checks[0].note}: not a regression")
        cmp.checks += checks
        if lim.timings and not same_hw:
            cmp.notes.append(
                f"{scope}: timings not compared, hardware differs ({hardware(b.config)} vs {hardware(c.config)})"
            )
        diff = [k for k in EXACT_KEYS if b.config.get(k) != c.config.get(k)]
        if diff:
            cmp.notes.append(f"{scope}: configs differ in {', '.join(diff)}: thresholds only, no exact comparison")
        else:
            cmp.differences += run_differences(scope, b, c)
        _version_note(cmp, scope, b.config, c.config)
    return cmp


def _version_note(cmp: Comparison, scope: str, b: dict, c: dict) -> None:
    vb, vc = b.get("versions") or {}, c.get("versions") or {}
    diff = [f"{k} {vb.get(k)} vs {vc.get(k)}" for k in ("torch", "transformers") if vb.get(k) != vc.get(k)]
    if diff:
        cmp.notes.append(f"{scope}: package versions differ ({', '.join(diff)})")


def _differ(a, b) -> bool:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)) or (isinstance(b, float) and math.isnan(b)):
        return not (_num_or_none(a) is None and _num_or_none(b) is None)
    return a != b


def _num_or_none(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def field_differences(scope: str, m: pd.DataFrame, keys: list[str], fields, what: str, tol: float = 0) -> list[str]:
    """One line per field of ``fields`` that differs between ``<f>_b`` and ``<f>_c`` in ``m``."""
    out = []
    for f in fields:
        if f"{f}_b" not in m or f"{f}_c" not in m:
            continue
        if tol:
            bad = [
                i
                for i, (x, y) in enumerate(zip(m[f"{f}_b"], m[f"{f}_c"]))
                if _differ(x, y)
                and not (x is not None and y is not None and math.isclose(x, y, rel_tol=tol, abs_tol=1e-6))
            ]
        else:
            bad = [i for i, (x, y) in enumerate(zip(m[f"{f}_b"], m[f"{f}_c"])) if _differ(x, y)]
        if bad:
            row = m.iloc[bad[0]]
            where = " ".join(f"{k} {_plain(row[k])}" for k in keys)
            out.append(
                f"{scope}: {f} differs in {len(bad)} of {len(m)} {what} (first: {where}: "
                f"{_show(row[f'{f}_b'])} -> {_show(row[f'{f}_c'])})"
            )
    return out


def _plain(v):
    """A value as plain Python (``np.True_`` -> ``True``, ``np.int64(3)`` -> ``3``, arrays -> lists)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    if isinstance(v, dict):
        return {_plain(k): _plain(x) for k, x in v.items()}
    return v


def _show(v) -> str:
    text = repr(_plain(v))
    return text if len(text) <= 40 else text[:37] + "..."


def run_differences(scope: str, b: Run, c: Run) -> list[str]:
    """Value-by-value differences of the deterministic records of a run pair."""
    s = b.samples.merge(c.samples, on="sample_id", suffixes=("_b", "_c"))
    out = field_differences(scope, s, ["sample_id"], ("prediction", "correct"), "samples")
    keys = ["sample_id", "step"]
    if b.requests.empty or c.requests.empty:
        return out
    r = b.requests.merge(c.requests, on=keys, suffixes=("_b", "_c"), how="outer", indicator=True)
    unmatched = int((r["_merge"] != "both").sum())
    if unmatched:
        out.append(f"{scope}: {unmatched} requests present on one side only")
    r = r[r["_merge"] == "both"]
    out += field_differences(scope, r, keys, EXACT_FIELDS, "requests")
    out += field_differences(scope, r, keys, FLOAT_FIELDS, "requests (rel. tol. 1e-3)", tol=1e-3)
    return out


# ---- sweeps --------------------------------------------------------------------------------------
def compare_sweeps(base_dir: str, cand_dir: str, lim: Limits) -> Comparison:
    b, c = load_sweep(base_dir), load_sweep(cand_dir)
    for key in INCOMPARABLE_SWEEP_KEYS:
        if b.config.get(key) != c.config.get(key):
            what = "traces" if key == "traces_sha256" else key
            raise BenchError(
                f"incomparable: the sweeps differ in {what} (baseline {b.config.get(key)!r}, "
                f"candidate {c.config.get(key)!r})"
            )
    key = ["method", "shared_tokens", "qps"]
    m = b.rows.merge(c.rows, on=key, suffixes=("_b", "_c"), how="left", indicator=True)
    missing = m[m["_merge"] != "both"]
    if len(missing):
        row = missing.iloc[0]
        raise BenchError(
            f"incomparable: the candidate sweep has no point {row['method']} at {row['shared_tokens']} shared "
            f"tokens, QPS {row['qps']:g}"
        )
    cmp = Comparison(base_dir, cand_dir, "sweep point", len(m), exact=lim.exact)
    same_hw = hardware(b.config) == hardware(c.config)
    timings = lim.timings and same_hw
    if lim.timings and not same_hw:
        cmp.notes.append(f"timings not compared, hardware differs ({hardware(b.config)} vs {hardware(c.config)})")
    for _, row in m.iterrows():
        cmp.checks += sweep_checks(row, lim, timings)
    diff = [k for k in EXACT_SWEEP_KEYS if b.config.get(k) != c.config.get(k)]
    if diff:
        cmp.notes.append(f"configs differ in {', '.join(diff)}: thresholds only, no exact comparison")
    else:
        cmp.differences += sweep_differences(b, c)
    _version_note(cmp, "sweep", b.config, c.config)
    return cmp


def sweep_checks(row: pd.Series, lim: Limits, timings: bool) -> list[Check]:
    scope = f"{row['method']}@{row['shared_tokens']} qps {row['qps']:g}"
    checks = [
        figure_check(scope, f, row.get(f"{f.name}_b"), row.get(f"{f.name}_c"), lim, timings)
        for f in figures.checked("sweep")
    ]
    return [c for c in checks if c is not None]


def sweep_differences(b: Sweep, c: Sweep) -> list[str]:
    """Value-by-value differences of the isolated measurements (``service.jsonl``)."""
    if b.service.empty or c.service.empty:
        return []
    keys = ["method", "shared_tokens", "trajectory", "step"]
    r = b.service.merge(c.service, on=keys, suffixes=("_b", "_c"))
    return field_differences("sweep", r, keys, EXACT_FIELDS, "measured requests")


# ---- entry points --------------------------------------------------------------------------------
def compare(baseline: str, candidate: str, limits: Limits | None = None) -> Comparison:
    """Compare two run/suite directories or two sweep directories (BenchError: unusable input)."""
    lim = limits or Limits()
    lim.validate()
    kb, kc = dir_kind(side_dirs(baseline)[0]), dir_kind(side_dirs(candidate)[0])
    if (kb == "sweep") != (kc == "sweep"):
        raise BenchError(f"incomparable: the baseline is a {kb} directory and the candidate a {kc} directory")
    if kb == "sweep" and len(side_dirs(baseline)) + len(side_dirs(candidate)) > 2:
        raise BenchError("a sweep is compared as one directory on each side (comma-separated lists are suite shards)")
    cmp = compare_sweeps(baseline, candidate, lim) if kb == "sweep" else compare_runs(baseline, candidate, lim)
    same = _sameness(Path(baseline), Path(candidate)) if "," not in baseline + candidate else None
    if same:
        cmp.notes.insert(0, same)
    return cmp


def _sameness(a: Path, b: Path) -> str | None:
    """A note when baseline and candidate are one directory, or hold byte-identical records (a
    PASS that compared nothing new)."""
    if a.resolve() == b.resolve():
        return "baseline and candidate are the same directory: nothing was compared"
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*.jsonl"))
    if files and files == sorted(str(p.relative_to(b)) for p in b.rglob("*.jsonl")):
        if all((a / f).read_bytes() == (b / f).read_bytes() for f in files):
            return "baseline and candidate hold byte-identical records (a copy?)"
    return None


_MD_HEAD = ["| status | scope | metric | baseline | candidate | change | allowed |", "|---|---|---|---:|---:|---:|---|"]


def markdown(cmp: Comparison) -> str:
    """A report fit for a pull-request comment: verdict, failed and skipped checks, the passing ones
    folded, the deterministic differences and the notes."""
    out = [
        f"## kvcmas-bench compare: {'FAIL' if cmp.regressed else 'PASS'}",
        "",
        f"Baseline `{cmp.baseline}` vs candidate `{cmp.candidate}`: {cmp.pairs} {cmp.kind} pairs, "
        f"{len(cmp.failures)} failed checks, {len(cmp.differences)} deterministic differences"
        + (" (each a regression: --exact)." if cmp.exact else " (listed, not failing; --exact fails on them)."),
        "",
    ]
    shown = sorted((c for c in cmp.checks if c.status != "ok"), key=lambda c: c.status != "FAIL")
    passing = [c for c in cmp.checks if c.status == "ok"]
    if shown:
        out += [*_MD_HEAD, *(_md_check(c) for c in shown), ""]
    if passing:
        out += [f"<details><summary>{len(passing)} passing checks</summary>", "", *_MD_HEAD]
        out += [_md_check(c) for c in passing] + ["", "</details>"]
    if cmp.differences:
        out += ["", "### Deterministic differences", ""] + [f"- {d}" for d in cmp.differences]
    if cmp.notes:
        out += ["", "### Notes", ""] + [f"- {n}" for n in cmp.notes]
    return "\n".join(out) + "\n"


def _md_check(c: Check) -> str:
    unit = {"s": " s", "MiB": " MiB"}.get(c.kind, "")
    status = {"FAIL": "**FAIL**", "skipped": f"skipped ({c.note})"}.get(c.status, c.status)
    return (
        f"| {status} | {c.scope} | {c.metric} | {cell(c.baseline, c.kind)}{unit} | "
        f"{cell(c.candidate, c.kind)}{unit} | {c.change} | {c.allowed}"
        + (f" ({c.note})" if c.note and c.status != "skipped" else "")
        + " |"
    )


def write_baseline(src: str, dst: str) -> Path:
    """A compact copy of a run or suite directory for ``benchmarks/baselines/``: what ``compare``
    reads, without per-layer errors, method details and the report."""
    kind = dir_kind(src)
    if kind == "sweep":
        raise BenchError("write_baseline takes a run or suite directory")
    out = Path(dst)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cells = [Path(src)]
    if kind == "suite":
        from ..results.frames import suite_cells

        shutil.copy(Path(src) / "suite.json", out / "suite.json")
        cells = suite_cells(src)
    for d in cells:
        target = out / d.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "summary.json", "samples.jsonl"):
            if (d / name).exists():
                shutil.copy(d / name, target / name)
        rows = [_slim(r) for r in read_jsonl(d / "requests.jsonl", required=False)]
        (target / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def _slim(rec: dict) -> dict:
    rec = {k: v for k, v in rec.items() if k != "method_stats"}
    drop = ("kv_rel_error_per_layer", "k_rel_error", "v_rel_error", "details")
    rec["segments"] = [{k: v for k, v in s.items() if k not in drop} for s in rec.get("segments", [])]
    return rec
