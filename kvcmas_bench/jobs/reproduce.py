"""The ``reproduce`` job: the paper's claims checked in one command.

``reproduce`` plans the experiments the selected claims need (:mod:`kvcmas_bench.reproduce.plan`),
prints the plan with its cost, runs each experiment as a child ``kvcmas-bench`` process into
``DIR/<experiment>/`` (its output in ``DIR/logs/<experiment>.log``), then re-derives the facts from
every experiment's validated records (:mod:`kvcmas_bench.reproduce.facts`), judges every claim's
rule (:mod:`kvcmas_bench.reproduce.rules`) and writes ``DIR/reproduce.md``, ``DIR/reproduce.html``
(self-contained), ``DIR/verdicts.csv`` and ``DIR/verdicts.json``.

Policy:

- ``DIR/reproduce.json`` is the manifest: the scale, model, device, dtype, seed and engine (a rerun
  with different ones is refused) and per experiment its command line and status. One writer at a
  time (the output-directory lock).
- An experiment recorded ``done`` with the same command line is not run again: a second
  invocation does no work beyond re-reading the records and re-writing the report. An experiment
  interrupted (Ctrl-C, ``kill -9``) is run again with the same command, which resumes it from its
  own records (the jobs' resume: nothing finished is redone, nothing is duplicated).
- An experiment that fails (exit code 2: a user-facing error such as a method that cannot run this
  model) is recorded with its last error line; its claims become ``not comparable`` with that
  reason; the other experiments still run; the command exits 2 at the end naming it.
- ``--claims`` runs only the experiments those claims need; the report judges only those claims.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..errors import BenchError
from ..reproduce.claims import Claim, load_claims, select_claims
from ..reproduce.facts import collect
from ..reproduce.plan import (
    SCALES,
    Experiment,
    TokenCost,
    command,
    human_bytes,
    human_seconds,
    measure_token_cost,
    nominal_cost,
    params_from_name,
    plan,
)
from ..reproduce.rules import NOT_COMPARABLE, VERDICTS, Verdict, evaluate
from ..results.frames import read_json
from ..results.outdir import atomic_write, lock_output_dir
from ..results.records import write_json
from ..settings import ModelSettings, cli, comma_list

STRICT = ("scale", "model", "device", "dtype", "seed", "engine", "vlm_model")
ENGINES = ("in-process", "vllm")


@dataclass(kw_only=True)
class ReproduceOptions(ModelSettings):
    """One ``reproduce``: the scale, the claims and the engine (model settings as every job)."""

    scale: str = "smoke"
    claims: list[str] | None = cli(None, parse=comma_list)
    engine: str = "in-process"
    vlm_model: str | None = None
    output_path: str = "runs/reproduce"
    dry_run: bool = False

    def validate(self) -> None:
        if self.scale not in SCALES:
            raise BenchError(f"--scale must be one of {', '.join(SCALES)}, got {self.scale!r}")
        if self.engine not in ENGINES:
            raise BenchError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    def settings(self) -> dict:
        return {k: getattr(self, k) for k in STRICT}


@dataclass
class Outcome:
    claim: Claim
    verdict: Verdict


@dataclass
class ReproduceResult:
    out_dir: Path
    experiments: list[Experiment]
    outcomes: list[Outcome] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    cost: TokenCost | None = None

    def counts(self) -> dict[str, int]:
        return {v: sum(o.verdict.verdict == v for o in self.outcomes) for v in VERDICTS}


def needed(claims: list[Claim], experiments: list[Experiment]) -> list[Experiment]:
    names = {c.experiment for c in claims}
    return [e for e in experiments if e.name in names]


def token_cost(opts: ReproduceOptions) -> TokenCost:
    """Measured on this device when the model loads here; else nominal from its parameter count."""
    try:
        return measure_token_cost(opts.model, opts.device, opts.dtype)
    except BenchError as exc:
        params = params_from_name(opts.model)
        if params is None:
            return TokenCost(
                float("nan"), float("nan"), f"unknown: the model did not load here ({exc}) and its name gives no size"
            )
        cost = nominal_cost(params)
        cost.notes.insert(0, f"the model did not load here: {exc}")
        return cost


def plan_lines(opts: ReproduceOptions, exps: list[Experiment], cost: TokenCost) -> list[str]:
    """The plan as printed before it runs (and alone under ``--dry-run``)."""
    lines = [f"reproduce --scale {opts.scale}: {len(exps)} experiment(s) into {opts.output_path}/"]
    total_s = total_req = total_b = 0.0
    for e in exps:
        cmd = "kvcmas-bench " + " ".join(
            command(e, f"{opts.output_path}/{e.name}", opts.model, opts.device, opts.dtype, opts.seed)
        )
        if e.skip:
            lines.append(f"  {e.name:<15} skipped: {e.skip}")
            continue
        s = cost.seconds(e)
        total_s += s
        total_req += e.requests
        total_b += e.disk_bytes
        lines.append(
            f"  {e.name:<15} {e.requests:>9,} requests  {e.prefill_tokens:>13,} prefill tok  "
            f"{e.decode_tokens:>11,} gen tok  ~{human_seconds(s):>9}  {e.what}"
        )
        lines.append(f"  {'':<15} {cmd}")
    lines.append(
        f"total: {int(total_req):,} requests, ~{human_seconds(total_s)} on this estimate, "
        f"~{human_bytes(total_b)} of records"
    )
    lines.append(f"per-token cost: {cost.basis}" + "".join(f"; {n}" for n in cost.notes))
    lines.append(
        "estimates count prefill and decode tokens, one request at a time (model loads, calibration "
        "overheads and queueing are not in them)"
    )
    return lines


def open_manifest(out: Path, opts: ReproduceOptions) -> dict:
    path = out / "reproduce.json"
    old = read_json(path) if path.exists() else None
    if old is None:
        if any(p.name not in (".kvcmas-bench.lock",) for p in out.iterdir()):
            raise BenchError(f"{out} is not empty and holds no reproduce.json; use another --output-path")
        return {"command": "reproduce", "settings": opts.settings(), "experiments": {}}
    if old.get("command") != "reproduce" or not isinstance(old.get("experiments"), dict):
        raise BenchError(f"{path} is not a reproduce manifest; use another --output-path")
    prev = old.get("settings", {})
    for k in STRICT:
        if prev.get(k) != getattr(opts, k):
            raise BenchError(
                f"{out} holds a reproduce with a different {k} ({prev.get(k)!r} vs {getattr(opts, k)!r}); "
                "use another --output-path"
            )
    return old


def precheck_dir(out: Path, opts: ReproduceOptions) -> None:
    """The output directory's refusals (another job's files, a reproduce of other settings) before
    the plan is printed and the model loads to cost it; checked again under the lock."""
    if out.exists() and not out.is_dir():
        raise BenchError(f"{out} is not a directory; use another --output-path")
    if out.is_dir():
        open_manifest(out, opts)


def _last_error(log: Path) -> str:
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    errs = [x for x in lines if x.startswith("error:")]
    return (errs or lines or ["no output"])[-1][:300]


def run_experiment(e: Experiment, argv: list[str], log: Path) -> tuple[int, float]:
    """Run ``kvcmas-bench ARGV`` as a child process, its output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        f.write(f"\n$ kvcmas-bench {' '.join(argv)}\n".encode())
        f.flush()
        env = {**os.environ, "COLUMNS": "100"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcmas_bench.cli", *argv], stdout=f, stderr=subprocess.STDOUT, env=env
        )
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.wait()  # the child got the same SIGINT and saves what it finished
            raise
    return rc, time.perf_counter() - t0


def reproduce(opts: ReproduceOptions, progress=None, say=print) -> ReproduceResult:
    """Plan, run what is not done, judge the claims and write the report."""
    opts.validate()
    all_exps = plan(opts.scale, opts.engine, opts.vlm_model)
    claims = select_claims(load_claims(experiments={e.name for e in all_exps}), opts.claims)
    exps = needed(claims, all_exps)
    from ..modeling import resolve_device, resolve_dtype

    resolve_dtype(opts.dtype)
    if not opts.dry_run:  # a dry run may plan for a device this machine lacks (its cost is then nominal)
        resolve_device(opts.device)
        precheck_dir(Path(opts.output_path), opts)
    cost = token_cost(opts)
    for line in plan_lines(opts, exps, cost):
        say(line)
    res = ReproduceResult(Path(opts.output_path), exps, cost=cost)
    if opts.dry_run:
        return res
    with lock_output_dir(opts.output_path) as out:
        manifest = open_manifest(out, opts)
        states = manifest["experiments"]
        todo = [e for e in exps if not e.skip]
        total = sum(_weight(cost, e) for e in todo)
        if progress is not None:
            progress.start(total)
        for e in todo:
            argv = command(e, str(out / e.name), opts.model, opts.device, opts.dtype, opts.seed)
            weight = _weight(cost, e)
            st = states.get(e.name, {})
            if st.get("status") == "done" and st.get("argv") == argv:
                if progress is not None:
                    progress.advance(weight, f"{e.name} (done before)")
                continue
            _mark_running(out, manifest, e.name, argv, progress)
            if progress is not None:
                progress.running(e.name)
            rc, secs = run_experiment(e, argv, out / "logs" / f"{e.name}.log")
            if rc == 130:
                raise KeyboardInterrupt
            if rc == 0:
                states[e.name] = {"argv": argv, "status": "done", "seconds": round(secs, 1)}
            else:
                why = _last_error(out / "logs" / f"{e.name}.log")
                states[e.name] = {
                    "argv": argv,
                    "status": "failed",
                    "exit_code": rc,
                    "error": why,
                    "seconds": round(secs, 1),
                }
                res.failed[e.name] = why
            write_json(out / "reproduce.json", manifest)
            if progress is not None:
                progress.advance(weight, e.name)
        if progress is not None:
            progress.stop()
        judge(res, claims, exps, out, states)
        res.files = write_report(res, out, opts)
    return res


def supersede(out: Path, name: str, state: dict, argv: list[str]) -> str | None:
    """An experiment whose command changed since it last ran (another version's plan, other model
    flags) meets a directory its new command may refuse or mix with: move that directory aside,
    to ``<name>.superseded-<k>`` beside it (nothing is deleted), and return the new name. None
    when the command is the same, or there was no earlier run or directory."""
    old = state.get("argv")
    here = out / name
    if old is None or old == argv or not here.exists():
        return None
    k = 1
    while (out / f"{name}.superseded-{k}").exists():
        k += 1
    here.rename(out / f"{name}.superseded-{k}")
    return f"{name}.superseded-{k}"


def _mark_running(out: Path, manifest: dict, name: str, argv: list[str], progress) -> None:
    """Record the experiment as running with ``argv`` (its old directory moved aside first when its
    command changed: :func:`supersede`)."""
    states = manifest["experiments"]
    moved = supersede(out, name, states.get(name, {}), argv)
    states[name] = {"argv": argv, "status": "running", **({"superseded": moved} if moved else {})}
    write_json(out / "reproduce.json", manifest)
    if moved and progress is not None and hasattr(progress, "note"):
        progress.note(f"{name}: its command changed since it ran; the old results moved to {moved}")


def _weight(cost: TokenCost, e: Experiment) -> float:
    """An experiment's share of the progress bar: its estimated seconds (1 when no cost is known)."""
    return 1.0 if math.isnan(cost.prefill_s) else max(cost.seconds(e), 1.0)


def judge(res: ReproduceResult, claims: list[Claim], exps: list[Experiment], out: Path, states: dict) -> None:
    """Collect the facts of every finished experiment and evaluate every claim's rule on them."""
    readable = {e.name: (e.reader, out / e.name) for e in exps if not e.skip and (out / e.name).exists()}
    facts, paired, problems = collect(readable)
    for e in exps:  # a part of an experiment run apart (Table 1's in-process methods beside vLLM's)
        if e.facts_as:
            facts.loc[facts["experiment"] == e.name, "experiment"] = e.facts_as
            paired.loc[paired["experiment"] == e.name, "experiment"] = e.facts_as
            if e.name in problems:
                problems.setdefault(e.facts_as, problems[e.name])
    by_name = {e.name: e for e in exps}
    for c in claims:
        e = by_name[c.experiment]
        st = states.get(e.name, {})
        if e.skip:
            v = Verdict(NOT_COMPARABLE, reason=f"experiment {e.name} skipped: {e.skip}")
        elif st.get("status") == "failed":
            v = Verdict(NOT_COMPARABLE, reason=f"experiment {e.name} failed: {st.get('error')}")
        elif e.name in problems:
            v = Verdict(NOT_COMPARABLE, reason=f"experiment {e.name} has unreadable records: {problems[e.name]}")
        else:
            v = evaluate(c.rule, facts, paired)
        res.outcomes.append(Outcome(c, v))


def _fmt(v: float | None) -> str:
    if v is None or v != v:
        return "-"
    if abs(v) == float("inf"):
        return "inf" if v > 0 else "-inf"
    return f"{v:.4g}"


def verdict_rows(res: ReproduceResult) -> list[dict]:
    rows = []
    for o in res.outcomes:
        c, v = o.claim, o.verdict
        interval = f"[{_fmt(v.low)}, {_fmt(v.high)}]" if v.low is not None and v.high is not None else ""
        ours = _fmt(v.value)
        if c.rule["form"] == "extreme" and v.value is not None:
            ours = f"{int(v.value)} of {v.n}"  # groups where it is the extreme, of those measured
        setting = ", ".join(f"{k} {x}" for k, x in c.setting.items())
        rows.append({
            "claim": c.id, "source": c.source, "paper": c.paper, "paper_setting": setting,
            "ours": ours, "interval": interval, "n": v.n, "verdict": v.verdict,
            "reason": v.reason, "rule": c.rule_text, "words": c.words, "note": c.note,
            "experiment": c.experiment,
        })  # fmt: skip
    return rows


def _figures(out: Path, exps: list[Experiment]):
    """The figures the experiments drew (PNG with its SVG twin), in plan order."""
    from ..report.plots import Figure

    figs = []
    for e in exps:
        root = out / e.name
        pngs = (
            sorted(root.glob("*.png")) + sorted(root.glob("figures/*.png")) + sorted(root.glob("report/figures/*.png"))
        )
        for png in pngs:
            caption = f"{e.name}: {png.stem.replace('_', ' ')}"
            figs.append(Figure(png.stem, caption, png, png.with_suffix(".svg")))
    return figs


def write_report(res: ReproduceResult, out: Path, opts: ReproduceOptions) -> list[Path]:
    from ..report.columns import Column
    from ..report.render import Document, Section, markdown, to_html
    from ..results.provenance import version_line

    rows = verdict_rows(res)
    counts = res.counts()
    cols = [
        Column("claim", "claim", "text", justify="left"),
        Column("paper", "paper", "text", justify="left"),
        Column("ours", "ours", "text"),
        Column("interval", "95% interval", "text"),
        Column("n", "n", "int"),
        Column("verdict", "verdict", "text", justify="left"),
        Column("reason", "why", "text", justify="left"),
    ]
    detail = [
        Column("claim", "claim", "text", justify="left"),
        Column("source", "source", "text", justify="left"),
        Column("words", "the paper's words", "text", justify="left"),
        Column("paper_setting", "paper's setting", "text", justify="left"),
        Column("rule", "rule", "text", justify="left"),
        Column("note", "note", "text", justify="left"),
    ]
    intro = [
        f"scale {opts.scale}; model {opts.model or 'SmolLM2-135M-Instruct (default)'}; device {opts.device}; "
        f"dtype {opts.dtype}; seed {opts.seed}; engine {opts.engine}",
        "verdicts: " + ", ".join(f"{v} {n}" for v, n in counts.items()),
        "a verdict is 'holds' only when the whole 95% interval satisfies the rule; 'inconclusive' when it "
        "straddles the threshold; 'not comparable' when a figure or experiment is missing (the reason says which)",
        "every figure is re-derived from the experiments' records (DIR/<experiment>/), never copied from a summary",
        version_line(),
    ]
    if res.failed:
        intro.append("failed experiments: " + "; ".join(f"{k}: {v}" for k, v in res.failed.items()))
    doc = Document(
        "KVCMAS paper claims: the paper's values beside ours",
        [x for x in intro if x],
        [Section("Verdicts", cols, rows), Section("Claims, settings and rules", detail, rows)],
        _figures(out, res.experiments),
    )
    files = []
    for name, text in (("reproduce.md", markdown(doc, out)), ("reproduce.html", to_html(doc))):
        atomic_write(out / name, text)
        files.append(out / name)
    atomic_write(out / "verdicts.csv", pd.DataFrame(rows).to_csv(index=False))
    files.append(out / "verdicts.csv")
    payload = {"counts": counts, "claims": rows, "failed": res.failed}
    atomic_write(out / "verdicts.json", json.dumps(payload, indent=2, default=str))
    files.append(out / "verdicts.json")
    return files
