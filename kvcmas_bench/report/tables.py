"""The report's tables as pandas frames: Table 1 per workload and agreement with NonShared.

Every figure is computed from the records (``samples.jsonl``, ``requests.jsonl``), so a run
without ``summary.json`` (killed before the end) is still reported; ``summary.json`` fields are
only optional extras (``runs.csv``).

**Agreement with NonShared**: a run's reference is the NonShared run with the same settings
(:data:`~kvcmas_bench.results.frames.SETTING_KEYS`: workload, model, dtype, seed, token budgets,
topology, ...) sharing the most samples with it. Per sample, the method agrees when its final
answer equals NonShared's on the same sample (``prediction``; HumanEval: the final output, since
its prediction is the sandbox verdict); per request (matched by ``sample_id``, ``step``), when its
first generated token equals NonShared's. NonShared against itself is 1.0 by construction.
"""

from __future__ import annotations

import pandas as pd

from ..results.frames import REFERENCE, Results, Run
from ..results.summary import reuse_ratio
from .columns import Column

#: the sample field compared for answer agreement, per workload (default ``prediction``)
ANSWER_FIELD = {"humaneval": "final_output"}
#: row order of the methods in tables (others follow in the order met)
METHOD_ORDER = (
    "nonshared",
    "fullshared",
    "cacheblend",
    "droidspeak",
    "relaycaching",
    "graphflow",
    "kvcomm",
    "kvcmas-nonchained",
    "kvcmas",
)


TABLE1 = (
    Column("label", "method", "text", 0, "left"),
    Column("n", "n", "int", 6),
    Column("accuracy", "accuracy", "acc", 0),
    Column("answer_agreement", "agree w/ NonShared", "acc", 1),
    Column("first_token_agreement", "first-token agree", "acc", 4),
    Column("latency_s", "E2E latency (s)", "s", 1),
    Column("ttft_s", "TTFT mean (s)", "s", 2),
    Column("ttft_p50_s", "TTFT p50 (s)", "s", 7),
    Column("ttft_p90_s", "TTFT p90 (s)", "s", 5),
    Column("peak_mem_bytes", "peak mem (MiB)", "MiB", 6),
    Column("method_state_bytes", "method state (MiB)", "MiB", 6),
    Column("reuse_ratio", "rho", "rho", 2),
    Column("kv_rel_error", "KV rel. error", "err", 8),
    Column("top1_agree", "top-1 agree", "acc", 8),
    Column("first_token_kl", "first-token KL", "kl", 9),
)
#: columns shown only when some row has a value
OPTIONAL = ("answer_agreement", "first_token_agreement", "kv_rel_error", "top1_agree", "first_token_kl")


def _mean(s: pd.Series) -> float | None:
    s = s.dropna()
    return float(s.astype(float).mean()) if len(s) else None


def run_metrics(run: Run) -> dict:
    """Table 1 figures of one run, from its records."""
    s, r = run.samples, run.requests
    out: dict = {"n": len(s)}
    if s.empty:
        return out
    out["accuracy"] = float(s["correct"].astype(float).mean())
    out["latency_s"] = _mean(s["latency_s"]) if "latency_s" in s else None
    if r.empty:
        return out
    out.update(
        ttft_s=float(r["ttft_s"].mean()),
        ttft_p50_s=float(r["ttft_s"].median()),
        ttft_p90_s=float(r["ttft_s"].quantile(0.9)),
        e2e_s=float(r["e2e_s"].mean()),
        peak_mem_bytes=_max(r["peak_mem_bytes"]),
        kv_state_peak_bytes=_max(r["kv_state_bytes"]),
        method_state_bytes=_max(r["method_state_bytes"]),
        reuse_ratio=reuse_ratio(r),
        prompt_tokens_mean=float(r["prompt_tokens"].mean()),
        prompt_tokens_max=int(r["prompt_tokens"].max()),
    )
    n_err = int(r["seg_kv_rel_error_n"].sum())
    out["kv_rel_error"] = float(r["seg_kv_rel_error_sum"].sum()) / n_err if n_err else None
    out["top1_agree"] = _mean(r["top1_agree"])
    out["first_token_kl"] = _mean(r["first_token_kl"])
    return out


def _max(s: pd.Series) -> int | None:
    s = s.dropna()
    return int(s.max()) if len(s) else None


def reference_for(run: Run, runs: list[Run]) -> Run | None:
    """The NonShared run with the same settings sharing the most samples with ``run`` (itself for
    a NonShared run), or None."""
    if run.method == REFERENCE:
        return run
    best, overlap = None, 0
    for ref in runs:
        if ref.method == REFERENCE and ref.settings() == run.settings():
            n = len(ref.sample_ids & run.sample_ids)
            if n > overlap:
                best, overlap = ref, n
    return best


def answer_key(run: Run) -> str:
    return ANSWER_FIELD.get(run.workload, "prediction")


def sample_agreement(run: Run, ref: Run) -> pd.DataFrame:
    """Per common sample: the method's answer, NonShared's, and whether they are equal."""
    key = answer_key(run)
    a = run.samples[["sample_id", key]].rename(columns={key: "answer"})
    b = ref.samples[["sample_id", key]].rename(columns={key: "reference_answer"})
    m = a.merge(b, on="sample_id")
    m["agree"] = [x == y or (pd.isna(x) and pd.isna(y)) for x, y in zip(m["answer"], m["reference_answer"])]
    return m


def request_agreement(run: Run, ref: Run) -> pd.DataFrame:
    """Per common request (``sample_id``, ``step``): both first tokens and whether they are equal."""
    cols = ["sample_id", "step", "agent", "first_token_id"]
    if run.requests.empty or ref.requests.empty or "first_token_id" not in run.requests:
        return pd.DataFrame(columns=[*cols, "reference_first_token_id", "agree"])
    if "first_token_id" not in ref.requests:
        return pd.DataFrame(columns=[*cols, "reference_first_token_id", "agree"])
    a = run.requests[cols]
    b = ref.requests[["sample_id", "step", "first_token_id"]].rename(
        columns={"first_token_id": "reference_first_token_id"}
    )
    m = a.merge(b, on=["sample_id", "step"]).dropna(subset=["first_token_id", "reference_first_token_id"])
    m["agree"] = m["first_token_id"].astype(int) == m["reference_first_token_id"].astype(int)
    return m


def agreement(run: Run, ref: Run | None) -> dict:
    """Answer and first-token agreement of ``run`` with its reference (None when there is none)."""
    if ref is None:
        return {}
    s = sample_agreement(run, ref)
    r = request_agreement(run, ref)
    return {
        "answer_agreement": float(s["agree"].mean()) if len(s) else None,
        "first_token_agreement": float(r["agree"].mean()) if len(r) else None,
        "agreement_samples": len(s),
        "reference": ref.run_id,
    }


def table1(results: Results) -> pd.DataFrame:
    """One row per run (workload, label, Table 1 figures, agreement), rows ordered by workload and
    method; ``acc_mark``: ``best`` / ``second`` accuracy among the sharing methods of a workload."""
    rows = []
    for run in results.runs:
        ref = reference_for(run, results.runs)
        rows.append(
            {
                "run_id": run.run_id,
                "workload": run.workload,
                "method": run.method,
                "label": run.label,
                "model": run.config.get("model"),
                "device": run.config.get("device"),
                **run_metrics(run),
                **agreement(run, ref),
            }
        )
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    workloads = {w: i for i, w in enumerate(dict.fromkeys(df["workload"]))}  # as met in the inputs
    df["_w"] = df["workload"].map(workloads)
    df["_m"] = df["method"].map(lambda m: order.get(m, len(order)))
    df = df.sort_values(["_w", "_m", "label"], kind="stable").drop(columns=["_w", "_m"])
    df["acc_mark"] = mark_best(df)
    return df.reset_index(drop=True)


def mark_best(df: pd.DataFrame) -> list[str]:
    """``best`` / ``second`` for the highest and second-highest accuracy among the sharing methods
    (every method but NonShared) of each workload and model; ties share a mark; nothing is marked
    when all of them tie."""
    marks = pd.Series("", index=df.index)
    for _, g in df.groupby(["workload", "model"], sort=False, dropna=False):
        sharing = g[(g["method"] != REFERENCE) & g["accuracy"].notna()]["accuracy"]
        levels = sorted(set(sharing), reverse=True)[:2]
        if len(levels) < 2:
            continue
        for idx, acc in sharing.items():
            if acc in levels:
                marks[idx] = ("best", "second")[levels.index(acc)]
    return marks.tolist()


def agreement_frame(results: Results) -> pd.DataFrame:
    """Per sample of every run with a reference: answer, NonShared's answer, agreement."""
    frames = []
    for run in results.runs:
        ref = reference_for(run, results.runs)
        if ref is not None:
            frames.append(sample_agreement(run, ref).assign(run_id=run.run_id, reference=ref.run_id))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def visible_columns(df: pd.DataFrame, columns=TABLE1) -> list[Column]:
    """Columns of ``columns`` present in ``df``; optional ones only when some row has a value."""
    return [c for c in columns if c.key in df and not (c.key in OPTIONAL and df[c.key].isna().all())]
