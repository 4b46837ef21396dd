"""The report's tables as pandas frames: Table 1 per comparison group, agreement with NonShared,
accuracy across repeats.

Every figure is computed from the records (``samples.jsonl``, ``requests.jsonl``) by
:func:`kvcmas_bench.results.summary.run_figures`, the function behind ``summary.json``: one
definition and one name per figure. ``summary.json`` fields are only optional extras (``runs.csv``).

**Comparison groups**: Table 1 compares the runs that evaluated the same prompts, i.e. agree on
:data:`~kvcmas_bench.results.frames.SETTING_KEYS` (workload, model, dtype, seed, token budgets,
topology, ...). Within a group every figure is computed over the samples *every* run of the group
finished (``n`` is that common count; ``n_finished`` each run's own; ``sample_scope``: ``all``
when every run finished the same samples, ``common`` when some were cut to the common ones); when
the runs share no sample at all (``own``), each row is over its own samples and nothing is marked.

**Agreement with NonShared**: a run's reference is the NonShared run with the same settings
sharing the most samples with it. Per sample, the method agrees when its final answer equals
NonShared's on the same sample (the workload's ``answer_field``: ``prediction``; HumanEval: the
final output, since its prediction is the sandbox verdict); per request (matched by
``sample_id``, ``step``), when its first generated token equals NonShared's. NonShared against
itself is 1.0 by construction.

**Uncertainty**: every proportion (accuracy, both agreements, top-1 agreement) carries
``<name>_se`` = sqrt(p(1-p)/n) (binomial, divisor n) and ``<name>_ci_low``/``_ci_high``, the 95%
Wilson score interval (:mod:`kvcmas_bench.results.stats`). The accuracy difference from NonShared
(``accuracy_delta``) carries the exact McNemar test on the paired samples (``mcnemar_b``: samples
the method gets right and NonShared wrong, ``mcnemar_c``: the reverse, ``mcnemar_p``).

**Noise floor** (:func:`noise_floor`): where a group holds two NonShared runs (e.g. on vLLM at two
concurrencies), their agreement is the engine's own noise for every agreement with NonShared
(``noise_answer_agreement``, ``noise_first_token_agreement``, ``noise_pair``), and each sharing
run's answer agreement is ``within noise`` unless it is significantly below the floor's
(``agreement_vs_noise``: exact McNemar on the paired per-sample agreements, p < :data:`MARK_ALPHA`).

**Best marks** (:func:`mark_best`): among the sharing methods of a group, ``best`` goes to the
highest accuracy only when it is significantly higher than *every* other one (exact McNemar,
two-sided p < :data:`MARK_ALPHA` on the common samples, each pair); ``second`` likewise to the
runner-up against every run below it. Otherwise the runs not significantly different from the top
(or the runner-up) are ``tied`` (``tied-second``), and the report says so.
"""

from __future__ import annotations

import json
import re

import pandas as pd

from ..registry import LiveMapping, LiveSequence
from ..results import figures
from ..results.frames import REFERENCE, SETTING_KEYS, Results, Run
from ..results.stats import discordant, mcnemar_exact, proportion
from ..results.summary import run_figures
from .columns import Column, figure_columns


def _answer_fields() -> dict[str, str]:
    from ..workloads import answer_fields  # lazily: importing the package loads every workload

    return answer_fields()


def _method_order() -> tuple[str, ...]:
    from ..methods import method_order  # lazily: the methods import torch

    return method_order()


#: the sample field compared for answer agreement, per workload (its class's ``answer_field``;
#: unknown workloads: ``prediction``)
ANSWER_FIELD = LiveMapping(_answer_fields)
#: row order of the methods in tables (their classes' ``order``); others follow, by label
METHOD_ORDER = LiveSequence(_method_order)
#: significance level of the best / second-best marks (exact McNemar, each pair)
MARK_ALPHA = 0.05
#: proportions shown with their standard error and 95% interval
ESTIMATES = LiveSequence(lambda: tuple(f.name for f in figures.FIGURES.values() if f.estimate))
#: Table 1's columns: the method, then every figure with a ``table1`` view (:mod:`kvcmas_bench.results.figures`)
TABLE1 = LiveSequence(lambda: figure_columns("table1", (Column("label", "method", "text", 0, "left"),)))


def _only(df: pd.DataFrame, ids: set | None) -> pd.DataFrame:
    if ids is None or df.empty or "sample_id" not in df:
        return df
    return df[df["sample_id"].isin(ids)]


def run_metrics(run: Run, ids: set | None = None) -> dict:
    """The figures of one run (:func:`~kvcmas_bench.results.summary.run_figures`, as in
    ``summary.json``), over the samples ``ids`` when given (their requests only)."""
    return run_figures(_only(run.samples, ids), _only(run.requests, ids))


def engine_of(run: Run) -> tuple[str, int]:
    """The engine that ran ``run`` and its samples in flight (``config.json``: ``engine``,
    ``max_concurrency``; the in-process engine runs one at a time)."""
    engine = str(run.config.get("engine") or "in-process")
    return ("vllm" if engine.startswith("vllm") else "in-process"), int(run.config.get("max_concurrency") or 1)


def reference_for(run: Run, runs: list[Run]) -> Run | None:
    """The NonShared run with the same settings sharing the most samples with ``run`` (itself for
    a NonShared run), or None; of several sharing as many, the one on the same engine and
    concurrency as ``run``."""
    if run.method == REFERENCE:
        return run
    best, rank = None, (0, False)
    for ref in runs:
        if ref.method == REFERENCE and ref.settings() == run.settings():
            n = len(ref.sample_ids & run.sample_ids)
            here = (n, engine_of(ref) == engine_of(run))
            if n > 0 and here > rank:
                best, rank = ref, here
    return best


def noise_floor(runs: list[Run], ids: set | None = None) -> tuple[Run, Run] | None:
    """Two NonShared runs of one comparison group (the first met, and the other sharing the most
    samples with it), whose agreement is the engine's own noise floor for every agreement with
    NonShared: greedy decoding on a batching engine is not batch-invariant, so NonShared can
    disagree with itself across concurrencies. None with fewer than two."""
    refs = [r for r in runs if r.method == REFERENCE and r.sample_ids]
    if len(refs) < 2:
        return None
    first = refs[0]
    other = max(refs[1:], key=lambda r: len(r.sample_ids & first.sample_ids & (ids or r.sample_ids)))
    return (first, other) if first.sample_ids & other.sample_ids else None


def _agree_vector(run: Run, ref: Run, ids: set) -> list[bool]:
    s = sample_agreement(run, ref, ids).set_index("sample_id")["agree"]
    return [bool(s.get(i, False)) for i in sorted(ids)]


def noise_figures(run: Run, ref: Run | None, floor: tuple[Run, Run] | None, ids: set | None) -> dict:
    """The group's noise floor beside ``run``'s agreement with its reference: the agreement of the
    floor's two NonShared runs (answers and first tokens), and for a sharing run whether its answer
    agreement is ``within noise`` (not below the floor's by exact McNemar on the paired samples,
    p >= :data:`MARK_ALPHA`: the accuracy marks' test) or ``below noise``."""
    if floor is None:
        return {}
    a, b = floor
    common = a.sample_ids & b.sample_ids & (ids if ids is not None else a.sample_ids)
    out = {f"noise_{k}": v for k, v in agreement(b, a, common).items() if k != "reference"}
    out["noise_pair"] = f"{a.run_id} vs {b.run_id}"
    if ref is None or run.method == REFERENCE:
        return out
    paired = common & run.sample_ids & ref.sample_ids
    if paired:
        mine, noise = _agree_vector(run, ref, paired), _agree_vector(b, a, paired)
        below = sum(mine) < sum(noise) and mcnemar_exact(*discordant(mine, noise)) < MARK_ALPHA
        out["agreement_vs_noise"] = "below noise" if below else "within noise"
    return out


def answer_key(run: Run) -> str:
    return ANSWER_FIELD.get(run.workload, "prediction")


def sample_agreement(run: Run, ref: Run, ids: set | None = None) -> pd.DataFrame:
    """Per common sample (of ``ids`` when given): the method's answer, NonShared's, and whether
    they are equal. An unparsed answer (None) agrees with nothing, another unparsed one included:
    two failures to answer are not the same answer. So NonShared's own row reads the share of its
    samples with a parsed answer, the ceiling any method's agreement can reach."""
    key = answer_key(run)
    a = _only(run.samples, ids)[["sample_id", key]].rename(columns={key: "answer"})
    b = ref.samples[["sample_id", key]].rename(columns={key: "reference_answer"})
    m = a.merge(b, on="sample_id")
    m["agree"] = [not pd.isna(x) and x == y for x, y in zip(m["answer"], m["reference_answer"])]
    return m


def request_agreement(run: Run, ref: Run, ids: set | None = None) -> pd.DataFrame:
    """Per common request (``sample_id``, ``step``; of the samples ``ids`` when given): both first
    tokens and whether they are equal."""
    cols = ["sample_id", "step", "agent", "first_token_id"]
    if run.requests.empty or ref.requests.empty or "first_token_id" not in run.requests:
        return pd.DataFrame(columns=[*cols, "reference_first_token_id", "agree"])
    if "first_token_id" not in ref.requests:
        return pd.DataFrame(columns=[*cols, "reference_first_token_id", "agree"])
    a = _only(run.requests, ids)[cols]
    b = ref.requests[["sample_id", "step", "first_token_id"]].rename(
        columns={"first_token_id": "reference_first_token_id"}
    )
    m = a.merge(b, on=["sample_id", "step"]).dropna(subset=["first_token_id", "reference_first_token_id"])
    m["agree"] = m["first_token_id"].astype(int) == m["reference_first_token_id"].astype(int)
    return m


def agreement(run: Run, ref: Run | None, ids: set | None = None) -> dict:
    """Answer and first-token agreement of ``run`` with its reference, each with its SE and 95%
    Wilson interval (``{}`` when there is no reference); over the samples ``ids`` when given."""
    if ref is None:
        return {}
    s = sample_agreement(run, ref, ids)
    r = request_agreement(run, ref, ids)
    return {
        **proportion(int(s["agree"].sum()), len(s), "answer_agreement"),
        **proportion(int(r["agree"].sum()), len(r), "first_token_agreement"),
        "agreement_samples": len(s),
        "reference": ref.run_id,
    }


def outcomes(run: Run, ids: set) -> list[bool]:
    """``correct`` of ``run`` on the samples ``ids``, in sample-id order (every id must be there)."""
    s = run.samples.set_index("sample_id")["correct"]
    return [bool(s[i]) for i in sorted(ids)]


def paired_accuracy(run: Run, ref: Run | None, ids: set | None = None) -> dict:
    """The accuracy difference from the reference on the samples both finished (of ``ids`` when
    given) and its exact McNemar test; ``{}`` for the reference itself or without one."""
    if ref is None or ref is run:
        return {}
    common = run.sample_ids & ref.sample_ids & (ids if ids is not None else run.sample_ids)
    if not common:
        return {}
    b, c = discordant(outcomes(run, common), outcomes(ref, common))
    return {
        "accuracy_delta": (b - c) / len(common),
        "mcnemar_b": b,
        "mcnemar_c": c,
        "mcnemar_p": mcnemar_exact(b, c),
        "paired_samples": len(common),
    }


def comparison_groups(runs: list[Run]) -> dict[tuple, list[Run]]:
    """Runs by what they evaluated (:meth:`Run.settings`), in the order met."""
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.settings(), []).append(r)
    return groups


def common_samples(runs: list[Run]) -> set:
    """The samples every run with finished samples finished (runs with none are left out)."""
    sets = [r.sample_ids for r in runs if r.sample_ids]
    return set.intersection(*sets) if sets else set()


def group_titles(groups: dict[tuple, list[Run]]) -> dict[tuple, str]:
    """The workload, plus the settings that tell apart several groups of one workload (``mmlu, seed=1``)."""
    by_workload: dict[str, list[tuple]] = {}
    for key, runs in groups.items():
        by_workload.setdefault(runs[0].workload, []).append(key)
    titles = {}
    for workload, keys in by_workload.items():
        cfgs = [groups[k][0].config for k in keys]
        differ = [k for k in SETTING_KEYS[1:] if len({json.dumps(c.get(k), sort_keys=True) for c in cfgs}) > 1]
        for key, cfg in zip(keys, cfgs):
            titles[key] = workload + "".join(f", {k}={cfg.get(k)}" for k in differ)
    return titles


def _group_rows(runs: list[Run], all_runs: list[Run], title: str, common: bool) -> list[dict]:
    """Table 1 rows of one comparison group, over its common samples (``common``) or each run's own."""
    ids = common_samples(runs) if common else set()
    scope = "own" if not ids else ("all" if all(r.sample_ids == ids for r in runs if r.sample_ids) else "common")
    use = ids or None
    floor = noise_floor(runs, use)
    rows = []
    for run in runs:
        ref = reference_for(run, all_runs) if run.sample_ids else None  # a run killed before its first sample
        rows.append(
            {
                "run_id": run.run_id,
                "table": title,
                "workload": run.workload,
                "method": run.method,
                "label": run.label,
                "model": run.config.get("model"),
                "device": run.config.get("device"),
                "seed": run.config.get("seed"),
                "n_finished": len(run.samples),
                "sample_scope": scope,
                **run_metrics(run, use),
                **agreement(run, ref, use),
                **paired_accuracy(run, ref, use),
                **noise_figures(run, ref, floor, use),
            }
        )
    sharing = {r.run_id: outcomes(r, ids) for r in runs if r.method != REFERENCE and ids and r.sample_ids}
    marks = mark_best(sharing)
    for row in rows:
        row["acc_mark"] = marks.get(row["run_id"], "")
    return rows


def table1(results: Results, common: bool = True) -> pd.DataFrame:
    """One row per run (table, workload, label, figures, agreement, paired test against NonShared),
    rows ordered by comparison group (as met) and method; ``acc_mark``: see :func:`mark_best`.

    ``common``: each group's figures over the samples all its runs finished (the report); False:
    every run over all its own samples (``compare``, which pairs runs across directories)."""
    groups = comparison_groups(results.runs)
    titles = group_titles(groups)
    rows = [row for key, runs in groups.items() for row in _group_rows(runs, results.runs, titles[key], common)]
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    order = {m: i for i, m in enumerate(_method_order())}
    tables = {t: i for i, t in enumerate(dict.fromkeys(df["table"]))}  # as met in the inputs
    df["_t"] = df["table"].map(tables)
    df["_m"] = df["method"].map(lambda m: order.get(m, len(order)))
    df = df.sort_values(["_t", "_m", "label"], kind="stable").drop(columns=["_t", "_m"])
    return df.reset_index(drop=True)


def _beats(a: list[bool], others: list[list[bool]], alpha: float) -> bool:
    """``a`` has a higher accuracy than each of ``others`` with exact McNemar p < ``alpha``."""
    return all(sum(a) > sum(o) and mcnemar_exact(*discordant(a, o)) < alpha for o in others)


def _tied(top: list[bool], rest: dict[str, list[bool]], alpha: float) -> list[str]:
    return [k for k, o in rest.items() if mcnemar_exact(*discordant(top, o)) >= alpha]


def mark_best(outcomes: dict[str, list[bool]], alpha: float = MARK_ALPHA) -> dict[str, str]:
    """Marks of the sharing runs of one group from their paired per-sample outcomes (the same
    samples, in the same order): ``best`` for the highest accuracy when it is significantly higher
    than every other's (exact McNemar, two-sided p < ``alpha`` against each: an intersection-union
    test, so no multiplicity correction); then ``second`` for the runner-up, by the same rule over
    the runs below it. Where the rule does not separate them, the top run and those not
    significantly different from it are ``tied`` (``tied-second`` at the second place); fewer than
    two runs: no marks."""
    ranked = sorted(outcomes, key=lambda k: -sum(outcomes[k]))  # stable: ties keep the input order
    if len(ranked) < 2:
        return {}
    marks: dict[str, str] = {}
    for place, (mark, tie) in enumerate((("best", "tied"), ("second", "tied-second"))):
        top, below = ranked[place], ranked[place + 1 :]
        if not below and place == 1:
            marks[top] = mark  # the only run below a separated best
            break
        if _beats(outcomes[top], [outcomes[k] for k in below], alpha):
            marks[top] = mark
            continue
        for k in [top, *_tied(outcomes[top], {k: outcomes[k] for k in below}, alpha)]:
            marks[k] = tie
        break
    return marks


def agreement_frame(results: Results) -> pd.DataFrame:
    """Per sample of every run with a reference: answer, NonShared's answer, agreement."""
    frames = []
    for run in results.runs:
        ref = reference_for(run, results.runs)
        if ref is not None:
            frames.append(sample_agreement(run, ref).assign(run_id=run.run_id, reference=ref.run_id))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def repeat_label(run: Run) -> str:
    """The run's label without its ``seed=`` part (repeats of one configuration differ only there)."""
    return re.sub(r" seed=\S+", "", run.label)


def _variant(run: Run) -> str:
    """What a run evaluated apart from the seed: repeats of one configuration share it."""
    keys = [k for k in SETTING_KEYS if k != "seed"]
    cfg = {k: run.config.get(k) for k in (*keys, "method", "method_config", "target_reuse")}
    return json.dumps(cfg, sort_keys=True, default=str)


def repeats_frame(results: Results, t1: pd.DataFrame) -> pd.DataFrame:
    """Accuracy across repeats (runs of one configuration at several seeds), per workload and
    method: mean and standard deviation (divisor n - 1) of the repeats' Table 1 accuracies (each
    over its group's common samples); empty when no configuration ran at more than one seed."""
    if t1.empty:
        return pd.DataFrame()
    runs = {r.run_id: r for r in results.runs}
    groups: dict[str, list[dict]] = {}
    for row in t1.to_dict("records"):
        groups.setdefault(_variant(runs[row["run_id"]]), []).append(row)
    out = []
    for rows in groups.values():
        seeds = [r["seed"] for r in rows]
        acc = pd.Series([r.get("accuracy") for r in rows], dtype=float).dropna()
        if len(set(map(str, seeds))) < 2 or acc.empty:
            continue
        first = runs[rows[0]["run_id"]]
        out.append(
            {
                "workload": first.workload,
                "method": first.method,
                "label": repeat_label(first),
                "repeats": len(rows),
                "seeds": ",".join(str(s) for s in seeds),
                "n_min": int(min(r["n"] for r in rows)),
                "n_max": int(max(r["n"] for r in rows)),
                "accuracy_mean": float(acc.mean()),
                "accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else None,
            }
        )
    return pd.DataFrame(out)


def section_rows(df: pd.DataFrame) -> list[dict]:
    """Table 1 rows for rendering: every proportion of :data:`ESTIMATES` as (value, SE, CI low, CI
    high), which the ``est`` cell format writes as ``0.833 ± 0.152 [0.436, 0.970]``."""
    rows = []
    for rec in df.to_dict("records"):
        for k in ESTIMATES:
            if k in rec:
                parts = tuple(rec.get(f"{k}{s}") for s in ("", "_se", "_ci_low", "_ci_high"))
                rec[k] = None if pd.isna(parts[0]) else parts
        rows.append(rec)
    return rows


def visible_columns(df: pd.DataFrame, columns=TABLE1) -> list[Column]:
    """Columns of ``columns`` present in ``df``; optional ones only when some row has a value."""
    return [c for c in columns if c.key in df and not (c.optional and df[c.key].isna().all())]
