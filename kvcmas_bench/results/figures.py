"""Every figure the project reports, defined once: its name, unit, definition and how it is computed.

A :class:`Figure` is one typed record. ``summary.json`` (:func:`kvcmas_bench.results.summary.run_figures`),
Table 1, the console tables, ``compare``'s checks and the serve-sweep rows and tables all read
:data:`FIGURES`; none of them names a figure's columns, headers or checks on its own. Adding a figure
is one :func:`register` call: a figure with ``compute`` and a ``views`` entry reaches every table
that view names (``tests/test_figures.py`` adds one from the test file alone).

Names follow one scheme, ``<quantity>[_<statistic>]_<unit>`` (``ttft_p50_s``, ``e2e_mean_s``,
``method_state_peak_bytes``); run directories written before the scheme carry older keys in
``summary.json``, which :func:`canonical` maps (:data:`LEGACY_NAMES`).

``compute(samples, requests)`` takes a run's (or a sweep point's) sample rows and flat request rows
(:func:`kvcmas_bench.results.frames.request_row`) as pandas frames and returns the value; an
``estimate`` figure returns ``(k, n)`` and is reported with its standard error and 95% Wilson
interval (``<name>_se``, ``<name>_ci_low``, ``<name>_ci_high``). Figures with ``compute=None`` are
computed where their inputs live (the agreement with NonShared needs the reference run; the TTFT
parts need the served timeline): the record still holds their one name, unit, header and definition.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .stats import percentile, proportion

if TYPE_CHECKING:
    import pandas as pd

#: the tables a figure can appear in: Table 1 of the report, the ``run`` console table, the
#: serve-sweep table (console and report) and its TTFT decomposition table
VIEWS = ("table1", "console", "sweep", "ttft_split")
#: the levels a figure is computed at: a run (samples and requests), a sweep point (requests)
SCOPES = ("run", "sweep")


@dataclass(frozen=True)
class View:
    """Where a figure stands in one table: ``pos`` orders the columns (lower first), ``priority``
    decides which columns a narrow console drops first (0 = always shown), ``header`` overrides the
    figure's own (a compact table's shorter title), ``optional``: left out when no row has a value."""

    pos: int
    priority: int = 5
    header: str | None = None
    optional: bool = False


@dataclass(frozen=True)
class CheckRule:
    """How ``compare`` checks a figure: ``drop`` (the candidate may not fall more than the limit) or
    ``increase`` (nor rise more); ``limit`` names the :class:`~kvcmas_bench.jobs.compare.Limits`
    field; ``timing``: a measured quantity, skipped across hardware and under ``--no-timings``, with
    the noise allowance; ``label`` the check's name in the verdict; ``order`` its place in the list;
    ``skip_reference``: not checked for NonShared's own row (1 by construction)."""

    kind: str
    limit: str
    label: str
    order: int
    timing: bool = False
    scopes: tuple[str, ...] = ("run",)
    skip_reference: bool = False


@dataclass(frozen=True)
class Figure:
    """One reported figure. ``kind`` is the cell format (:func:`kvcmas_bench.report.columns.cell`)."""

    name: str
    header: str
    unit: str
    definition: str
    compute: Callable[[pd.DataFrame, pd.DataFrame], Any] | None = None
    kind: str = "num"
    scopes: tuple[str, ...] = ("run",)
    needs: str = "requests"
    estimate: bool = False
    views: dict[str, View] = field(default_factory=dict)
    check: CheckRule | None = None
    legacy: tuple[str, ...] = ()

    def keys(self) -> tuple[str, ...]:
        """The row keys the figure fills: its name, and for an estimate its SE and interval."""
        if self.estimate:
            return (self.name, f"{self.name}_se", f"{self.name}_ci_low", f"{self.name}_ci_high")
        return (self.name,)

    def evaluate(self, samples: pd.DataFrame, requests: pd.DataFrame) -> dict:
        """``{key: value}`` of the figure over the given rows ({} when its inputs are absent)."""
        rows = samples if self.needs == "samples" else requests
        if self.compute is None or rows is None or rows.empty:
            return {}
        value = self.compute(samples, requests)
        if self.estimate:
            return proportion(*value, self.name)
        return {self.name: value}


FIGURES: dict[str, Figure] = {}


def register(fig: Figure) -> Figure:
    """Add a figure (its name and legacy names must be new)."""
    taken = set(FIGURES) | set(LEGACY_NAMES)
    clash = [n for n in (fig.name, *fig.legacy) if n in taken]
    if clash:
        raise ValueError(f"figure name already defined: {', '.join(clash)}")
    bad = [v for v in fig.views if v not in VIEWS] + [s for s in fig.scopes if s not in SCOPES]
    if bad:
        raise ValueError(f"figure {fig.name}: unknown view or scope {', '.join(bad)}")
    FIGURES[fig.name] = fig
    LEGACY_NAMES.update({old: fig.name for old in fig.legacy})
    return fig


@contextmanager
def registered(fig: Figure):
    """The figure registered for the duration of a ``with`` block (tests, plug-ins)."""
    register(fig)
    try:
        yield fig
    finally:
        FIGURES.pop(fig.name, None)
        for old in fig.legacy:
            LEGACY_NAMES.pop(old, None)


#: old key -> current name, for ``summary.json`` files written before the naming scheme
LEGACY_NAMES: dict[str, str] = {}


def canonical(row: dict) -> dict:
    """A summary or table row with every legacy key renamed to the figure's current name (a current
    key present beside its legacy one wins)."""
    out = {}
    for k, v in row.items():
        new = LEGACY_NAMES.get(k)
        if new is None:
            out[k] = v
        elif new not in row:
            out[new] = v
    return out


def evaluate(samples: pd.DataFrame, requests: pd.DataFrame, scope: str = "run") -> dict:
    """Every computed figure of ``scope`` over the rows, in registration order."""
    out: dict = {}
    for fig in FIGURES.values():
        if scope in fig.scopes:
            out.update(fig.evaluate(samples, requests))
    return out


def in_view(view: str) -> list[tuple[Figure, View]]:
    """The figures shown in ``view`` with their place there, ordered by position."""
    rows = [(f, f.views[view]) for f in FIGURES.values() if view in f.views]
    return sorted(rows, key=lambda fv: fv[1].pos)


def checked(scope: str) -> list[Figure]:
    """The figures ``compare`` checks at ``scope`` (run or sweep), in check order."""
    figs = [f for f in FIGURES.values() if f.check is not None and scope in f.check.scopes]
    return sorted(figs, key=lambda f: f.check.order)


def definitions(scope: str) -> dict[str, str]:
    """``{name: definition}`` of the figures of ``scope`` (written beside the figures)."""
    return {f.name: f.definition for f in FIGURES.values() if scope in f.scopes}


# ---- the computations ---------------------------------------------------------------------------
def _max(s: pd.Series) -> int | None:
    s = s.dropna()
    return int(s.max()) if len(s) else None


def _mean(s: pd.Series) -> float | None:
    s = s.dropna().astype(float)
    return float(s.mean()) if len(s) else None


def _column(name: str, fn: Callable[[pd.Series], Any]) -> Callable[[pd.DataFrame, pd.DataFrame], Any]:
    def compute(samples: pd.DataFrame, requests: pd.DataFrame):
        return fn(requests[name])

    return compute


def _sample_column(name: str, fn: Callable[[pd.Series], Any]) -> Callable[[pd.DataFrame, pd.DataFrame], Any]:
    def compute(samples: pd.DataFrame, requests: pd.DataFrame):
        return fn(samples[name]) if name in samples else None

    return compute


def _pct(q: float) -> Callable[[pd.Series], float | None]:
    return lambda s: percentile(s.dropna(), q)


def accuracy_counts(samples: pd.DataFrame, requests: pd.DataFrame) -> tuple[int, int]:
    correct = samples["correct"].astype(bool)
    return int(correct.sum()), len(correct)


def reuse_ratio(r: pd.DataFrame) -> float | None:
    """rho = (token, layer) entries served by reuse / reuse-eligible shared entries, over request
    rows (or per-segment rows) with ``eligible_tokens``/``tokens``, ``reused_tokens``,
    ``recomputed_token_layers`` and ``layers``."""
    tokens = r["eligible_tokens"] if "eligible_tokens" in r else r["tokens"]
    eligible = float((tokens * r["layers"]).sum())
    if eligible == 0:
        return None
    served = float((r["reused_tokens"] * r["layers"]).sum() - r["recomputed_token_layers"].sum())
    rho = served / eligible
    return None if math.isnan(rho) else rho


def kv_rel_error(samples: pd.DataFrame, r: pd.DataFrame) -> float | None:
    n_err = int(r["seg_kv_rel_error_n"].sum())
    return float(r["seg_kv_rel_error_sum"].sum()) / n_err if n_err else None


def top1_counts(samples: pd.DataFrame, r: pd.DataFrame) -> tuple[int, int]:
    top1 = r["top1_agree"].dropna().astype(bool)
    return int(top1.sum()), len(top1)


def _reuse(samples: pd.DataFrame, r: pd.DataFrame) -> float | None:
    return reuse_ratio(r)


def mean_of(values: Iterable) -> float | None:
    """Mean of the values that are not None/NaN (None when none are)."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(vals)) if vals else None


# ---- the figures ---------------------------------------------------------------------------------
_TTFT = "time to first token per agent request (run: measured on the engine; sweep: arrival to first token under load)"
_PCT = "numpy.percentile, linear interpolation"
_BOTH = ("run", "sweep")
#: the parts of a request's TTFT under load (queue + service = TTFT), as serving.metrics splits it
TTFT_PARTS = (
    "queue",
    "queue_dense",
    "queue_other",
    "service",
    "service_shared_dense",
    "service_shared_reuse",
    "service_other",
)
#: the statistics the TTFT parts are reported at
TTFT_PART_STATS = ("p50", "p90", "mean")


register(
    Figure(
        "n",
        "n",
        "samples",
        "samples the figures are computed over",
        None,
        "int",
        views={"table1": View(10, 6), "console": View(10, 3)},
    )
)
register(
    Figure(
        "accuracy",
        "accuracy ± SE [95% CI]",
        "share",
        "share of samples whose final answer the workload scores correct; accuracy_se = sqrt(p(1-p)/n) (binomial, "
        "divisor n), accuracy_ci_low/high = the 95% Wilson score interval",
        accuracy_counts,
        "est",
        needs="samples",
        estimate=True,
        views={"table1": View(20, 0), "console": View(20, 0, "accuracy")},
        check=CheckRule("drop", "accuracy_drop", "accuracy", 10),
    )
)
register(
    Figure(
        "accuracy_delta",
        "acc. - NonShared",
        "share",
        "accuracy minus the NonShared run's on the same samples",
        None,
        "diff",
        views={"table1": View(30, 3, optional=True)},
    )
)
register(
    Figure(
        "mcnemar_p",
        "McNemar p",
        "p-value",
        "exact McNemar test of the accuracy difference on the paired samples",
        None,
        "p",
        views={"table1": View(31, 3, optional=True)},
    )
)
# agreement with NonShared on the same samples (computed where the reference run is: report.tables)
for _name, _header, _definition, _pos, _priority, _label in (
    (
        "answer_agreement",
        "agree w/ NonShared ± SE [95% CI]",
        "share of samples whose final answer equals NonShared's on the same sample",
        40,
        1,
        "agreement",
    ),
    (
        "first_token_agreement",
        "first-token agree ± SE [95% CI]",
        "share of requests whose first generated token equals NonShared's (matched by sample and step)",
        41,
        4,
        "first-token agreement",
    ),
):
    register(
        Figure(
            _name,
            _header,
            "share",
            _definition,
            None,
            "est",
            estimate=True,
            views={"table1": View(_pos, _priority, optional=True)},
            check=CheckRule("drop", "agreement_drop", _label, _pos, skip_reference=True),
        )
    )
register(
    Figure(
        "latency_mean_s",
        "E2E latency (s)",
        "s",
        "sum of the agents' end-to-end times per sample, mean over samples",
        _sample_column("latency_s", _mean),
        "s",
        needs="samples",
        legacy=("latency_s",),
        views={"table1": View(60, 1), "console": View(60, 0, "latency (s)")},
    )
)
register(
    Figure(
        "latency_p50_s",
        "E2E latency p50 (s)",
        "s",
        f"median of the per-sample latencies ({_PCT})",
        _sample_column("latency_s", lambda s: percentile(s.dropna().astype(float), 50)),
        "s",
        needs="samples",
        legacy=("latency_s_p50",),
    )
)

register(
    Figure(
        "ttft_mean_s",
        "TTFT mean (s)",
        "s",
        f"{_TTFT}, mean over requests",
        _column("ttft_s", lambda s: float(s.mean())),
        "s",
        _BOTH,
        legacy=("ttft_s",),
        views={"table1": View(70, 2), "console": View(70, 0, "TTFT (s)"), "sweep": View(75, 7, "mean")},
        check=CheckRule("increase", "ttft_increase", "TTFT", 50, timing=True),
    )
)


def _register_ttft_percentiles() -> None:
    for q, table_pri, sweep_pos, sweep_pri in ((50, 7, 30, 0), (90, 5, 40, 0), (99, None, 50, 4)):
        views = {"sweep": View(sweep_pos, sweep_pri, "TTFT p50" if q == 50 else f"p{q}")}
        if table_pri is not None:
            views["table1"] = View(70 + q / 100, table_pri)
        if q == 90:
            views["console"] = View(71, 2, "TTFT p90 (s)")
        if q != 99:
            views["ttft_split"] = View(10 if q == 50 else 50, 0, "TTFT p50" if q == 50 else "p90")
        register(
            Figure(
                f"ttft_p{q}_s",
                f"TTFT p{q} (s)",
                "s",
                f"{_TTFT}, {q}th percentile over requests ({_PCT})",
                _column("ttft_s", _pct(q)),
                "s",
                _BOTH,
                legacy=(f"ttft_s_p{q}",) if q != 99 else (),
                views=views,
                check=CheckRule("increase", "ttft_increase", f"TTFT p{q}", 50 + q / 100, True, ("sweep",))
                if q != 99
                else None,
            )
        )


_register_ttft_percentiles()
register(
    Figure(
        "e2e_mean_s",
        "E2E mean (s)",
        "s",
        "end-to-end time per agent request, mean over requests",
        _column("e2e_s", lambda s: float(s.mean())),
        "s",
        _BOTH,
        legacy=("e2e_s",),
    )
)


def _register_e2e_percentiles() -> None:
    for q in (50, 90, 99):
        register(
            Figure(
                f"e2e_p{q}_s",
                f"E2E p{q} (s)",
                "s",
                f"end-to-end time per agent request, {q}th percentile ({_PCT})",
                _column("e2e_s", _pct(q)),
                "s",
                ("sweep",),
            )
        )


_register_e2e_percentiles()

register(
    Figure(
        "peak_mem_bytes",
        "peak mem (MiB)",
        "bytes",
        "max over requests of the device peak (CUDA) or the process peak RSS (CPU)",
        _column("peak_mem_bytes", _max),
        "MiB",
        _BOTH,
        views={"table1": View(80, 6), "console": View(80, 1), "sweep": View(90, 5, "peak MiB")},
        check=CheckRule("increase", "memory_increase", "peak mem", 70, True, _BOTH),
    )
)
register(
    Figure(
        "peak_rss_bytes",
        "peak RSS (MiB)",
        "bytes",
        "max over requests of the process peak RSS",
        _column("peak_rss_bytes", _max),
        "MiB",
    )
)
register(
    Figure(
        "kv_state_peak_bytes",
        "KV+state peak (MiB)",
        "bytes",
        "max over requests of the live KV cache (request KV + the trajectory's shared-segment store) plus the "
        "method's state",
        _column("kv_state_bytes", _max),
        "MiB",
        _BOTH,
        views={"console": View(81, 2), "sweep": View(91, 7, "KV+state MiB")},
        check=CheckRule("increase", "memory_increase", "KV+state", 25, scopes=("sweep",)),
    )
)
register(
    Figure(
        "method_state_peak_bytes",
        "method state (MiB)",
        "bytes",
        "max over requests of the method's own state (anchor pools, references, calibration tables)",
        _column("method_state_bytes", _max),
        "MiB",
        _BOTH,
        legacy=("method_state_bytes",),
        views={"table1": View(82, 6)},
        check=CheckRule("increase", "memory_increase", "method state", 30),
    )
)


def _register_token_sums() -> None:
    for name, what in (
        ("prefilled_tokens", "tokens prefilled (densely computed)"),
        ("reused_tokens", "shared-segment tokens served from a reused cache"),
        ("eligible_tokens", "tokens of reuse-eligible shared segments"),
        ("reference_tokens", "tokens of context-free reference prefills"),
        ("recomputed_token_layers", "(token, layer) entries recomputed inside reused segments"),
    ):
        register(
            Figure(
                name,
                name.replace("_", " "),
                "tokens",
                f"{what}, summed over requests",
                _column(name, lambda s: int(s.sum())),
                "int",
                _BOTH,
            )
        )


_register_token_sums()
register(
    Figure(
        "prompt_tokens_mean",
        "prompt tokens",
        "tokens",
        "prompt length per request, mean",
        _column("prompt_tokens", lambda s: float(s.mean())),
        "num",
        _BOTH,
    )
)
register(
    Figure(
        "prompt_tokens_max",
        "max prompt tokens",
        "tokens",
        "prompt length per request, max",
        _column("prompt_tokens", lambda s: int(s.max())),
        "int",
    )
)
register(
    Figure(
        "output_tokens_mean",
        "output tokens",
        "tokens",
        "generated tokens per request, mean",
        _column("output_tokens", lambda s: float(s.mean())),
        "num",
        ("sweep",),
    )
)
register(
    Figure(
        "reuse_ratio",
        "rho",
        "share",
        "rho = (shared token, layer) entries served by reuse / entries of reuse-eligible shared segments. "
        "Eligibility is fixed before the method runs, by method family and segment: source-based methods "
        "(nonshared, fullshared, cacheblend, droidspeak, relaycaching, chained kvcmas) count the shared segments "
        "that have a source; context-free-reference methods (kvcomm, kvcmas-nonchained, graphflow) count every "
        "shared segment, the first agent's included. A dense fallback stays in the denominator; recomputed "
        "(token, layer) entries are not served by reuse. Per segment: eligible, reused_tokens, prefilled_tokens, "
        "reference_tokens, recomputed_token_layers in requests.jsonl.",
        _reuse,
        "rho",
        _BOTH,
        views={"table1": View(85, 2), "console": View(85, 0), "sweep": View(10, 0), "ttft_split": View(5, 0)},
        check=CheckRule("drop", "rho_drop", "rho", 20, scopes=_BOTH),
    )
)

register(
    Figure(
        "kv_rel_error",
        "KV rel. error",
        "ratio",
        "||C_method - C_full||_F / ||C_full||_F over K and V of one shared segment, C_full the rows of a "
        "full dense prefill of the same prompt (one forward from position 0), averaged over every shared "
        "segment of every request (dense segments included: after a corrected one they differ from C_full; "
        "otherwise only by float rounding). Per segment, local_kv_rel_error in requests.jsonl is the "
        "conditional figure: against a dense prefill of the segment over the cache as the method built it",
        kv_rel_error,
        "err",
        views={"table1": View(90, 8, optional=True)},
    )
)
register(
    Figure(
        "top1_agree",
        "top-1 agree ± SE [95% CI]",
        "share",
        "share of requests whose first generated token equals the dense prefill's, with top1_agree_se and the 95% "
        "Wilson interval as for accuracy (requests counted as independent trials)",
        top1_counts,
        "est",
        estimate=True,
        views={"table1": View(91, 8, optional=True)},
    )
)
register(
    Figure(
        "first_token_kl",
        "first-token KL",
        "nats",
        "mean KL of the first token's distribution from the dense one",
        _column("first_token_kl", _mean),
        "kl",
        views={"table1": View(92, 9, optional=True)},
    )
)

# Figures of a sweep point computed from the served timeline (``kvcmas_bench.serving.metrics``).
register(
    Figure(
        "rho_target",
        "rho set",
        "share",
        "with --matched-rho: the rho the method was set to",
        None,
        "rho",
        ("sweep",),
        views={"sweep": View(20, 2, optional=True)},
    )
)
register(
    Figure(
        "throughput_tok_s",
        "tok/s",
        "tokens/s",
        "generated tokens per second of makespan",
        None,
        "num",
        ("sweep",),
        views={"sweep": View(80, 6)},
    )
)
register(
    Figure(
        "service_e2e_mean_s",
        "svc s",
        "s",
        "end-to-end time per request measured in isolation, mean",
        None,
        "s",
        ("sweep",),
        views={"sweep": View(95, 3)},
    )
)


def _register_ttft_parts() -> None:
    split = {
        ("p50", "queue"): (View(31, 1, "p50 queue"), View(30, 0, "queue")),
        ("p90", "queue"): (View(41, 2, "p90 queue"), View(52, 1, "p90 queue")),
        ("p50", "service"): (None, View(11, 0, "svc")),
        ("p50", "service_shared_dense"): (None, View(12, 3, "svc dense")),
        ("p50", "service_shared_reuse"): (None, View(13, 3, "svc reuse")),
        ("p50", "queue_dense"): (None, View(31, 2, "q behind dense")),
        ("p90", "service"): (None, View(51, 1, "p90 svc")),
        ("p90", "queue_dense"): (None, View(53, 4, "p90 q behind dense")),
    }
    for stat in TTFT_PART_STATS:
        for part in TTFT_PARTS:
            sweep, ttft_split = split.get((stat, part), (None, None))
            views = {k: v for k, v in (("sweep", sweep), ("ttft_split", ttft_split)) if v is not None}
            register(
                Figure(
                    f"ttft_{stat}_{part}_s",
                    f"TTFT {stat} {part.replace('_', ' ')} (s)",
                    "s",
                    f"the {part} part of the TTFT at its {stat} (serving.metrics.ttft_breakdown)",
                    None,
                    "s",
                    ("sweep",),
                    views=views,
                )
            )


_register_ttft_parts()
register(
    Figure(
        "queue_dense_share",
        "share of queue behind dense",
        "share",
        "sum of queue_dense / sum of queue over the point's requests",
        None,
        "rho",
        ("sweep",),
        views={"ttft_split": View(60, 0)},
    )
)
register(
    Figure(
        "dense_fallback_share",
        "dense fallback reqs",
        "share",
        "share of the point's requests whose service prefilled a reuse-eligible shared segment densely",
        None,
        "rho",
        ("sweep",),
        views={"ttft_split": View(61, 5)},
    )
)
