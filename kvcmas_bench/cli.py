"""Command line: ``kvcmas-bench run | suite | report | compare | serve-sweep | analyze | ablate | methods | ...``.

Every user error (unknown method, missing model, bad numbers) ends as one line on stderr and
exit code 2; Ctrl-C keeps everything finished so far and the same command resumes.
"""

from __future__ import annotations

import functools
import sys

import typer

try:  # typer >= 0.2x vendors its own click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from .console import fmt, print_run_summary
from .errors import BenchError, os_error_reason
from .options import (
    BUDGET_PARAMS,
    ENGINE_PARAMS,
    KNOB_PARAMS,
    MODEL_PARAMS,
    Agents,
    CalibSamples,
    CellProcess,
    Device,
    DryRun,
    Dtype,
    EngineArg,
    EngineName,
    Fidelity,
    Limit,
    LogPrompts,
    MaxNewTokens,
    MethodArg,
    Methods,
    Model,
    OutputPath,
    Plots,
    ReportFormat,
    Rounds,
    Topology,
    UnsafeSandbox,
    Warmup,
    Workload,
    Workloads,
    takes,
)
from .settings import comma_items, from_cli, parse_pairs

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: readable at 80 columns, nothing truncated, no markup printed
    help="Benchmark cross-agent KV-cache sharing methods on multi-agent workloads.",
)
err = Console(stderr=True)
out = Console()


def _version(value: bool) -> None:
    if value:
        from .results.provenance import version_line

        out.print(version_line(), highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version (and git commit) and exit."
    ),
) -> None:
    """Benchmark cross-agent KV-cache sharing methods on multi-agent workloads."""


class Interrupted(Exception):
    """Ctrl-C during a job, carried past the CLI framework (which turns KeyboardInterrupt into exit
    130 before :func:`main` could tell the user how to resume)."""


def on_interrupt(message: str):
    """Decorate a job command: Ctrl-C ends it with exit 130 and ``message`` (what was kept, how to go on)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:
                raise Interrupted(f"interrupted: {message}") from None

        return inner

    return wrap


class _Rate(ProgressColumn):
    """Samples per second over rich's recent window ("-" before the second sample)."""

    def render(self, task) -> Text:
        return Text(f"{task.speed:.2f} samples/s" if task.speed else "- samples/s")


class _Progress:
    """Rich progress bar over samples, on stderr: done/total, running accuracy, samples/s, elapsed
    time and the ETA."""

    def __init__(self):
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            _Rate(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err,
            transient=False,
        )
        self.correct = 0
        self.n = 0

    def start(self, total: int, done: int) -> None:
        self.bar.start()
        self.task = self.bar.add_task("samples", total=total, completed=done, acc="-")

    def note(self, message: str) -> None:
        """One line about the run before its samples start (on stderr, above the bar)."""
        err.print(message, highlight=False)

    def resumed(self, samples: list[dict]) -> None:
        """The samples a resumed run finished before: counted in the accuracy shown."""
        self.n += len(samples)
        self.correct += sum(bool(s.get("correct")) for s in samples)
        if self.n:
            self.bar.update(self.task, acc=f"{self.correct / self.n:.3f}")

    def advance(self, rec: dict) -> None:
        self.n += 1
        self.correct += int(rec["correct"])
        self.bar.update(self.task, advance=1, acc=f"{self.correct / self.n:.3f}")

    def stop(self) -> None:
        self.bar.stop()


@app.command()
@on_interrupt("finished samples are saved; run the same command again to resume")
@takes(MODEL_PARAMS, BUDGET_PARAMS, KNOB_PARAMS, ENGINE_PARAMS)
def run(
    method: str = typer.Option("nonshared", help="Sharing method (see `kvcmas-bench methods`)."),
    workload: Workload = "mmlu",
    limit: Limit = None,
    output_path: OutputPath = "runs/latest",
    subjects: str | None = typer.Option(None, help="MMLU subjects, comma-separated (e.g. 'anatomy,virology')."),
    data_path: str | None = typer.Option(
        None,
        help="Local data file, or 'hub[:repo]' for the hub dataset; "
        "videomme: the folder holding the Video-MME videos (required).",
    ),
    fidelity: Fidelity = False,
    target_reuse: float | None = typer.Option(
        None,
        help="Pick tau on calibration samples to reach this reuse ratio (KVCMAS/KVComm); the chosen tau is recorded.",
    ),
    topology: Topology = "chain",
    agents: Agents = None,
    rounds: Rounds = 1,
    calib_samples: CalibSamples = 4,
    warmup: Warmup = 0,
    log_prompts: LogPrompts = False,
    unsafe_sandbox: UnsafeSandbox = False,
    **shared,
) -> None:
    """Run one method on one workload and write config/samples/requests/summary into OUTPUT_PATH."""
    from .jobs.run import RunOptions
    from .jobs.run import run as do_run

    opts = from_cli(RunOptions, locals() | shared)
    progress = _Progress()
    try:
        summary = do_run(opts, progress=progress)
    finally:
        if hasattr(progress, "task"):
            progress.stop()
    print_run_summary(summary, out)
    err.print(f"results in {output_path}/ (summary.json, samples.jsonl, requests.jsonl, config.json)")


@app.command("serve-sweep")
@on_interrupt("measured (method, shared length) groups are saved; run the same command again to resume")
@takes(MODEL_PARAMS, KNOB_PARAMS)
def serve_sweep_cmd(
    methods: Methods = "all",
    qps: str = typer.Option(
        "0,1,2,4,8", help="Trajectory arrival rates (starts/s), comma-separated; 0 = single stream."
    ),
    shared_tokens: str = typer.Option(
        "2048",
        help="Non-generated shared context lengths, comma-separated "
        "(with --accumulated: accumulated agent-output lengths).",
    ),
    num_trajectories: int = typer.Option(4, "--num-trajectories", "--trajectories", help="Evaluated trajectories."),
    output_path: OutputPath = "runs/serve-sweep",
    burstiness: float = typer.Option(1.0, help="Gamma shape of inter-arrival gaps (1 = Poisson), as vllm bench serve."),
    output_tokens: int = typer.Option(128, help="Tokens each agent generates (EOS ignored, as --ignore-eos)."),
    accumulated: bool = typer.Option(False, help="Shared context accumulated from agent outputs (paper B.6)."),
    traces: str | None = typer.Option(None, help="Replay a saved traces.jsonl exactly."),
    calib_trajectories: int = typer.Option(2, help="Held-out trajectories for calibration / pool warm-up."),
    warmup_trajectories: int = typer.Option(
        0,
        help="More held-out trajectories every method serves before measurement (pools in steady state, "
        "as in a long-running service; excluded from the statistics), like vllm bench serve --num-warmups.",
    ),
    matched_rho: str | None = typer.Option(
        None,
        "--matched-rho",
        help="Serve every method at a matched reuse ratio: DELTA[,RECOMPUTE], or the paper's pairs paper-0.8 "
        "(= 0.8,0.9) and paper-0.6 (= 0.6,0.8). A seeded schedule, the same for every method, prefills 1 - DELTA "
        "of the eligible shared tokens densely and reuses the rest (FullShared, GraphFlow, KVComm, KVCMAS, "
        "whatever their gates say); CacheBlend/DroidSpeak/RelayCaching get --rho RECOMPUTE (default DELTA). "
        "Without it the gated methods reach the rho their tau gives.",
    ),
    engine: EngineName = "in-process",
    backend: str | None = typer.Option(None, "--backend", hidden=True, help="Old name of --engine."),
    engine_arg: EngineArg = None,
    **shared,
) -> None:
    """Serve controlled 4-agent traces with every method across QPS. The in-process engine measures
    each request once (one request at a time) and replays Poisson arrivals at every QPS on a
    virtual-clock FCFS server; --engine vllm serves them for real with continuous batching (a KV
    connector injects the shared caches; the harness is the HTTP client of a `vllm serve` it starts,
    or of --engine-arg base_url=URL). Writes requests.jsonl, summary.json (TTFT p50/p90/p99 split
    into own service and queueing, realized rho ...) and TTFT-vs-QPS plots. --matched-rho compares
    the methods at matched amounts of dense prefill (paper Figure 5)."""
    from .jobs.sweep import SweepOptions, run_sweep

    if backend is not None and engine not in ("in-process", backend):
        raise BenchError(f"--backend is the old name of --engine; give one (got --engine {engine} --backend {backend})")
    opts = from_cli(SweepOptions, locals() | shared, engine=backend or engine)
    run_sweep(opts)
    err.print(f"results in {output_path}/ (summary.json, requests.jsonl, service.jsonl, traces.jsonl, plots)")


@app.command("serve")
def serve_cmd(
    model: Model = None,
    port: int = typer.Option(8000, help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    device: Device = "auto",
    dtype: Dtype = "auto",
    engine_arg: EngineArg = None,
    dry_run: DryRun = False,
) -> None:
    """Start `vllm serve` with the KVCMAS connector (the deployment `serve-sweep --engine vllm
    --engine-arg base_url=http://HOST:PORT` benchmarks). Prints the exact command, then runs it.
    --dtype auto (the default here): bfloat16 on CUDA, float32 on CPU. The command loads the
    connector's edge check of kv_transfer_params (--middleware), which a shared deployment needs."""
    import os
    import shlex

    from .modeling import resolve_device, resolve_dtype
    from .serving.vllm.http import ServerOptions, _dtype_arg, _has_cuda, serve_command, server_env
    from .serving.vllm.inprocess import _resolve_model

    if dtype != "auto":
        resolve_dtype(dtype)  # the command's own options first, then what it needs installed
    resolve_device(device)
    if not 0 < port < 65536:
        raise BenchError(f"--port must lie in [1, 65535], got {port}")
    opts = ServerOptions.parse(parse_pairs("--engine-arg", engine_arg))
    path, _ = _resolve_model(model)
    cpu = device == "cpu" or (device == "auto" and not _has_cuda())
    cmd = serve_command(path, port, _dtype_arg(dtype, cpu), opts, cpu, host=host)
    env = {k: v for k, v in server_env(opts, cpu).items() if k not in os.environ}
    sys.stderr.write(" ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(c) for c in cmd]) + "\n")
    if dry_run:
        return
    os.environ.update(env)
    os.execv(cmd[0], cmd)


analyze_app = typer.Typer(
    no_args_is_help=True,
    help="The paper's analyses: effective rank of caches and deltas, chained vs non-chained error, coverage.",
)
app.add_typer(analyze_app, name="analyze")


@on_interrupt("coverage is computed in one go and nothing was written; run the command again")
@takes(MODEL_PARAMS)
def coverage_cmd(
    workload: Workload = "mmlu",
    limit: Limit = 4,
    rhos: str = typer.Option("0.9,0.8", "--rho", help="Reuse ratios; the recomputation budget is 1 - rho."),
    max_new_tokens: MaxNewTokens = None,
    output_path: OutputPath = "runs/coverage",
    method_arg: MethodArg = None,
    **shared,
) -> None:
    """Reconstruction coverage of selective recomputation (paper Table 2) on the shared segments of
    WORKLOAD's agent workflow: the share of reuse error that layer (DroidSpeak), deviation (CacheBlend)
    and attention (RelayCaching) selection remove at the same budget, and that share relative to random
    selection. --method-arg sets the criteria's options: check_layer, score_on (deviation criterion),
    max_groups (layer criterion)."""
    from .jobs.coverage import CoverageOptions, coverage_report

    df = coverage_report(from_cli(CoverageOptions, locals() | shared))
    t = Table(title=f"reconstruction coverage on {workload} ({limit} samples)")
    cols = ["rho", "criterion", "coverage", "relative_coverage", "norm_coverage", "observations"]
    for c in cols:
        t.add_column(c, justify="right")
    for _, row in df.iterrows():
        t.add_row(*[fmt(row[c]) for c in cols])
    out.print(t)
    err.print(f"results in {output_path}/ (coverage.csv, coverage.json)")


analyze_app.command("coverage")(coverage_cmd)
app.command("coverage", help="Alias of `analyze coverage`. " + (coverage_cmd.__doc__ or ""))(coverage_cmd)


@analyze_app.command("rank")
@on_interrupt("the rank analysis is computed in one go and nothing was written; run the command again")
@takes(MODEL_PARAMS, BUDGET_PARAMS)
def analyze_rank_cmd(
    workloads: Workloads = "mmlu",
    limit: Limit = 8,
    energy: float = typer.Option(0.9, help="Share of the squared singular values the effective rank keeps."),
    ranks: str = typer.Option("1,2,4,8,16,32,64", help="Retained ranks of the reconstruction-error curve."),
    output_path: OutputPath = "runs/analyze-rank",
    plots: Plots = True,
    **shared,
) -> None:
    """Effective rank per layer (minimum rank keeping --energy of the singular-value energy) of base
    caches, PH-induced and PF-induced deltas, K and V apart, and the relative reconstruction error vs
    retained rank, per workload (paper Figures 2 and 7). --limit needs at least 2 samples."""
    from .jobs.analyze import RankOptions, rank_analysis

    res = rank_analysis(from_cli(RankOptions, locals() | shared))
    from .console import print_rank_summary

    print_rank_summary(res.summary, energy, out)
    err.print(f"results in {output_path}/ (rank_summary.csv, rank_per_layer.csv, rank_recon.csv, rank.json, figures/)")


@analyze_app.command("chain")
@on_interrupt("finished samples are saved; run the same command again to resume")
@takes(MODEL_PARAMS, BUDGET_PARAMS, KNOB_PARAMS)
def analyze_chain_cmd(
    workloads: Workloads = "mmlu",
    methods: Methods = "kvcmas,kvcmas-nonchained",
    limit: Limit = 8,
    topology: Topology = "chain",
    output_path: OutputPath = "runs/analyze-chain",
    calib_samples: CalibSamples = 4,
    warmup: Warmup = 0,
    plots: Plots = True,
    cell_process: CellProcess = "auto",
    **shared,
) -> None:
    """Relative KV error of chained vs non-chained correction over the same samples, per layer and per
    agent in execution order (paper Figure 3); one resumable run directory per method (--fidelity).
    --methods: the chained and the non-chained method compared; --tau 1 accepts every gated decision."""
    from .console import print_chain
    from .jobs.ablate import AblateOptions
    from .jobs.analyze import chain_analysis

    opts = from_cli(AblateOptions, locals() | shared, kind="chain")
    res = _with_progress(chain_analysis, opts)
    print_chain(res.per_agent, out)
    for note in res.notes:
        err.print(f"[yellow]nothing to compare:[/] {note}", highlight=False)
    err.print(f"results in {output_path}/ (chain_per_agent.csv, chain_per_layer.csv, figures/, one run per method)")
    _raise_failed(res.failed, output_path)


def _with_progress(job, opts):
    """Run a matrix job (suite, ablation, chain analysis) under the suite's progress display."""
    from .console import SuiteProgress

    progress = SuiteProgress(err)
    try:
        return job(opts, progress=progress)
    finally:
        if hasattr(progress, "matrix"):
            progress.stop()


def _raise_failed(failed: dict, output_path: str, total: int | None = None, what: str = "point(s)") -> None:
    if failed:
        first, msg = next(iter(failed.items()))
        n = f"{len(failed)} of {total}" if total is not None else str(len(failed))
        raise BenchError(f"{n} {what} failed ({first}: {msg}); see {output_path}/suite.json")


@app.command("ablate")
@on_interrupt("finished samples are saved; run the same command again to resume")
@takes(MODEL_PARAMS, BUDGET_PARAMS, KNOB_PARAMS, ENGINE_PARAMS)
def ablate_cmd(
    kind: str = typer.Argument(..., help="rank, anchors, tau, agents or rounds."),
    values: str | None = typer.Option(
        None,
        help="Swept values (rank: 16,32,64 (full = full-dimensional); anchors: 1,2,5,10,20; "
        "tau: 0.1,0.3,0.5,0.7,0.9; agents: 2,4,8; rounds: 1,2,3).",
    ),
    delta_ranks: str | None = typer.Option(
        None, help="rank: delta ranks r_D (every pair with --values); default r_D = r_C."
    ),
    gates: str | None = typer.Option(None, help="tau: gates, paper and/or scaled (default both)."),
    rhos: str | None = typer.Option(None, help="tau: reuse ratios of the recomputation methods (default 0.6,0.8,0.9)."),
    methods: Methods = None,
    workloads: Workloads = "mmlu",
    limit: Limit = 8,
    output_path: OutputPath = None,
    fidelity: Fidelity = True,
    calib_samples: CalibSamples = 4,
    warmup: Warmup = 0,
    log_prompts: LogPrompts = False,
    topology: Topology = "chain",
    plots: Plots = True,
    cell_process: CellProcess = "auto",
    **shared,
) -> None:
    """The paper's ablations as resumable sweeps: rank (r_C, r_D), anchors (V), tau (both gates; rho,
    agreement with NonShared, KV error, TTFT; fidelity vs rho at matched rho), agents and rounds. Each
    point is an ordinary run directory (`report DIR` reads them all); writes ablate-KIND.csv/.md and figures
    into OUTPUT_PATH (unset: runs/ablate-KIND). --methods unset: kvcmas (tau: kvcmas, kvcomm, cacheblend,
    droidspeak, relaycaching; agents and rounds: kvcmas, cacheblend); NonShared is always added as the
    reference. The knob flags and --method-arg set every point's other knobs."""
    from .console import print_ablation
    from .jobs.ablate import AblateOptions

    target = output_path or f"runs/ablate-{kind}"
    opts = from_cli(AblateOptions, locals() | shared, output_path=target)
    from .jobs.ablate import run_ablation

    res = _with_progress(run_ablation, opts)
    print_ablation(res.table, kind, out)
    for note in res.notes:
        err.print(f"[yellow]warning:[/] {note}", highlight=False)
    err.print(f"results in {target}/ ({', '.join(p.name for p in res.files)}, figures/, one run per point)")
    _raise_failed(res.failed, target)


@app.command("suite")
@on_interrupt("finished samples are saved; run the same command again to resume")
@takes(MODEL_PARAMS, BUDGET_PARAMS, KNOB_PARAMS, ENGINE_PARAMS)
def suite_cmd(
    methods: Methods = "all",
    workloads: Workloads = "mmlu",
    limit: Limit = None,
    output_path: OutputPath = "runs/suite",
    fidelity: Fidelity = False,
    calib_samples: CalibSamples = 4,
    warmup: Warmup = 0,
    log_prompts: LogPrompts = False,
    report_format: ReportFormat = "md,html",
    plots: Plots = True,
    repeats: int = typer.Option(
        1, help="Run every cell N times, repeat r with seed SEED+r (in DIR/repeat-r/); the report adds mean and std."
    ),
    shard: str | None = typer.Option(
        None,
        help="K/N: run only the K-th of N disjoint slices of the cells (a job array); `report`/`compare` merge the N "
        "shard directories into one suite.",
    ),
    unsafe_sandbox: UnsafeSandbox = False,
    cell_process: CellProcess = "auto",
    **shared,
) -> None:
    """Run a matrix of methods x workloads (one resumable run directory per cell, the same samples for
    every method, NonShared as the reference, always added) and write the report (Table 1, agreement,
    Pareto plots). With --shard K/N, one slice of the cells into its own directory."""
    from .jobs.report import console_table1
    from .jobs.suite import SuiteOptions, run_suite

    opts = from_cli(SuiteOptions, locals() | shared)
    res = _with_progress(run_suite, opts)
    if res.report is not None:
        console_table1(res.report, out)
        err.print(f"report in {res.report.out_dir}/ ({', '.join(p.name for p in res.report.files)}, figures/)")
    _raise_failed(res.failed, output_path, len(res.cells), "cells")


class _PlanProgress:
    """One bar over the whole reproduce plan, weighted by each experiment's estimated seconds."""

    def start(self, total: float) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=err, transient=False,
        )  # fmt: skip
        self.bar.start()
        self.task = self.bar.add_task("reproduce", total=total)

    def running(self, name: str) -> None:
        self.bar.update(self.task, description=f"running {name} (log: logs/{name}.log)")

    def note(self, message: str) -> None:
        """One line above the bar (an experiment's old results moved aside)."""
        err.print(message, highlight=False, markup=False)

    def advance(self, weight: float, name: str) -> None:
        self.bar.update(self.task, advance=weight, description=f"finished {name}")

    def stop(self) -> None:
        if hasattr(self, "bar"):
            self.bar.stop()


@app.command("reproduce")
@on_interrupt("finished experiments are kept; run the same command again to resume")
@takes(MODEL_PARAMS)
def reproduce_cmd(
    scale: str = typer.Option(
        "smoke", help="smoke (2-core CPU, < 30 min), small (one GPU, hours) or paper (the paper's settings)."
    ),
    claims: str | None = typer.Option(None, help="Claim ids, comma-separated (default: every claim; see --list)."),
    engine: EngineName = "in-process",
    vlm_model: str | None = typer.Option(
        None, help="A vision-language model for the VLM experiments (skipped without one)."
    ),
    output_path: OutputPath = "runs/reproduce",
    dry_run: DryRun = False,
    list_claims: bool = typer.Option(
        False, "--list", help="List the claims with their experiment and rule, run nothing."
    ),
    **shared,
) -> None:
    """Check the KVCMAS paper's claims: run the experiments they need (suite, ablate, analyze,
    serve-sweep; one subdirectory each, resumable), re-derive every figure from the records, and
    write DIR/reproduce.md and .html with the paper's value beside ours and a verdict per claim
    (holds / does not hold / inconclusive / not comparable, with the reason)."""
    from .jobs.reproduce import ReproduceOptions, reproduce
    from .reproduce.claims import load_claims

    if list_claims:
        for c in load_claims():
            out.print(
                f"{c.id:<29} {c.experiment:<15} paper {c.paper}; rule {c.rule_text}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        return
    opts = from_cli(ReproduceOptions, locals() | shared)
    progress = _PlanProgress()
    try:
        res = reproduce(
            opts, progress=progress, say=lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True)
        )
    finally:
        progress.stop()
    if opts.dry_run:
        return
    counts = ", ".join(f"{v} {n}" for v, n in res.counts().items())
    out.print(f"{len(res.outcomes)} claims: {counts}", highlight=False)
    err.print(f"report in {output_path}/ (reproduce.md, reproduce.html, verdicts.csv, verdicts.json)")
    if res.failed:
        first, msg = next(iter(res.failed.items()))
        raise BenchError(f"{len(res.failed)} experiment(s) failed ({first}: {msg}); see {output_path}/logs/")


@app.command("report")
def report_cmd(
    dirs: list[str] = typer.Argument(..., help="Run, suite and serve-sweep directories."),
    output_path: OutputPath = None,
    report_format: ReportFormat = "md,html",
    plots: Plots = True,
) -> None:
    """Table 1 per workload (accuracy, latency, TTFT, memory, rho, fidelity, agreement with NonShared),
    Pareto plots, sweep TTFT-vs-QPS figures; Markdown, one self-contained HTML page, CSV/Parquet frames,
    into OUTPUT_PATH (unset: DIR/report for one input, else runs/report)."""
    from .jobs.report import build_report, console_table1

    target = output_path or (f"{dirs[0].rstrip('/')}/report" if len(dirs) == 1 else "runs/report")
    res = build_report(dirs, target, comma_items("--format", report_format), plots)
    console_table1(res, out)
    err.print(f"report in {target}/ ({', '.join(p.name for p in res.files)}{', figures/' if res.figures else ''})")


@app.command("compare")
def compare_cmd(
    baseline: str = typer.Argument(
        ..., help="Baseline run, suite or sweep directory (a sharded suite: its shard directories, comma-separated)."
    ),
    candidate: str = typer.Argument(..., help="Candidate directory of the same kind (shards: comma-separated)."),
    max_accuracy_drop: str = typer.Option("0", help="Allowed accuracy drop: absolute (0.02) or relative (5%)."),
    max_agreement_drop: str = typer.Option(
        "0", help="Allowed drop of agreement with NonShared (answers, first tokens)."
    ),
    max_rho_drop: str = typer.Option("0", help="Allowed reuse-ratio drop."),
    max_ttft_increase: str = typer.Option("10%", help="Allowed TTFT increase: seconds or relative."),
    max_memory_increase: str = typer.Option("10%", help="Allowed memory increase: bytes (64MiB) or relative."),
    noise: str = typer.Option("25%", help="Noise allowance on timings and measured peak memory."),
    timings: bool = typer.Option(True, help="Check timings and peak memory (skipped anyway across hardware)."),
    exact: bool = typer.Option(False, help="Fail on any difference of deterministic values where configs match."),
    markdown: str | None = typer.Option(None, "--markdown", help="Write a Markdown report (for a PR comment)."),
    significance: float | None = typer.Option(
        None, help="Count an accuracy drop only when the exact McNemar p on the paired samples is below ALPHA."
    ),
) -> None:
    """Compare a candidate against a baseline: one-line verdict on stdout; exit 0 pass, 1 regression,
    2 unusable input (missing, corrupt or incomparable: other model, samples or seed)."""
    from .jobs.compare import Limits, compare, parse_threshold
    from .jobs.compare import markdown as to_markdown
    from .results.outdir import check_output_file, write_output_file

    lim = Limits(
        accuracy_drop=parse_threshold("--max-accuracy-drop", max_accuracy_drop),
        agreement_drop=parse_threshold("--max-agreement-drop", max_agreement_drop),
        rho_drop=parse_threshold("--max-rho-drop", max_rho_drop),
        ttft_increase=parse_threshold("--max-ttft-increase", max_ttft_increase),
        memory_increase=parse_threshold("--max-memory-increase", max_memory_increase, byte_units=True),
        noise=_fraction("--noise", noise),
        timings=timings,
        exact=exact,
        significance=significance,
    )
    if markdown:  # an unwritable report path is unusable input (exit 2), found before any comparison
        check_output_file(markdown, "--markdown")
    cmp = compare(baseline, candidate, lim)
    if markdown:
        write_output_file(markdown, to_markdown(cmp))
    from .console import print_compare

    print_compare(cmp, err)
    out.print(cmp.verdict(), soft_wrap=True, markup=False, highlight=False)
    if cmp.regressed:
        raise typer.Exit(1)


def _fraction(flag: str, text: str) -> float:
    from .jobs.compare import parse_threshold

    t = parse_threshold(flag, text)
    return t.value


@app.command("methods")
def list_methods(
    options: bool = typer.Option(
        False, "--options", help="Also list each method's options (for --method-arg) with defaults."
    ),
) -> None:
    """List the available sharing methods."""
    from .methods import METHODS

    t = Table(title="methods")
    t.add_column("name")
    t.add_column("what it does")
    if options:
        t.add_column("options (defaults)")
    for name, cls in METHODS.items():
        if name.startswith("_"):
            continue
        row = [name, cls.summary]
        if options:
            row.append(", ".join(_knob_text(k, f, cls) for k, f in cls.knobs().items()) or "-")
        t.add_row(*row)
    out.print(t)


def _knob_text(name: str, f, cls) -> str:
    """``name=default``, with the valid values of a knob that declares them (``svd='auto'
    (auto|gram|...)``) and its per-workload defaults where they differ (``tau=0.3 (mmlu 0.29, ...)``)."""
    from .workloads import WORKLOADS

    text = f"{name}={f.default!r}"
    opts = f.metadata.get("choices")
    if opts:
        text += f" ({'|'.join('none' if c is None else str(c) for c in opts)})"
    per = {w: cls.workload_defaults(wl).get(name) for w, wl in WORKLOADS.items() if not w.startswith("_")}
    per = {w: v for w, v in per.items() if v is not None and v != f.default}
    return text + f" (per workload: {', '.join(f'{w} {v}' for w, v in per.items())})" if per else text


@app.command("engines")
def list_engines() -> None:
    """List the serving engines (``serve-sweep --engine``), one ServingEngine plugin each."""
    from .serving.engines import ENGINES

    t = Table(title="serving engines (serve-sweep --engine)")
    t.add_column("name")
    t.add_column("what it is")
    for name, factory in ENGINES.items():
        t.add_row(name, _first_sentence(factory.__doc__ or ""))
    out.print(t)


def _first_sentence(doc: str) -> str:
    """The first sentence of a docstring as plain text: its lines joined (a sentence may wrap),
    reST ``literals`` shown as `literals`."""
    text = " ".join(doc.split()).replace("``", "`")
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


app.command("backends", hidden=True, help="Old name of `engines`.")(list_engines)


@app.command("workloads")
def list_workloads() -> None:
    """List the available workloads."""
    from .workloads import WORKLOADS

    t = Table(title="workloads")
    t.add_column("name")
    t.add_column("agents")
    t.add_column("tau")
    t.add_column("data")
    for name, cls in WORKLOADS.items():
        agents = " -> ".join([r.name for r in cls.roles] + [cls.final_role.name])
        t.add_row(name, agents, "-" if cls.default_tau is None else str(cls.default_tau), cls.summary)
    out.print(t)


def _fail(msg: str) -> None:
    sys.stderr.write(f"kvcmas-bench: error: {msg}\n")
    sys.stderr.flush()
    sys.exit(2)


def _os_error(exc: OSError) -> str:
    """``cannot write /x/y: No space left on device``: an OSError as one line."""
    reason = os_error_reason(exc)
    return f"{reason}: {exc.filename}" if exc.filename else reason


def main(argv: list[str] | None = None) -> None:
    """Console entry point with one-line errors and exit code 2."""
    from .console import quiet_libraries

    quiet_libraries()
    from .results import provenance

    provenance.COMMAND_LINE = ["kvcmas-bench", *(sys.argv[1:] if argv is None else argv)]
    cmd = typer.main.get_command(app)
    try:
        rc = cmd.main(args=argv, prog_name="kvcmas-bench", standalone_mode=False)
    except BenchError as exc:
        _fail(str(exc))
    except OSError as exc:  # a file or folder the up-front checks could not foresee (disk full, permissions)
        _fail(_os_error(exc))
    except click_exc.ClickException as exc:
        _fail(" ".join(exc.format_message().split()))
    except Interrupted as exc:
        sys.stderr.write(f"\n{exc}\n")
        sys.stderr.flush()
        sys.exit(130)
    except (KeyboardInterrupt, getattr(click_exc, "Abort", KeyboardInterrupt)):
        sys.stderr.write("\ninterrupted\n")
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
