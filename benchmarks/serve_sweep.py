#!/usr/bin/env python
"""Serving-efficiency benchmark (paper Section 4.3 / Fig. 5) on the default model.

Measures NonShared, FullShared, KVComm, GraphFlow and KVCMAS once on controlled four-agent traces
(2K non-generated shared tokens by default; every method first serves held-out warm-up trajectories
so online pools are in steady state, as in a long-running service), then replays the measured
service times on a one-request-at-a-time FCFS server at increasing trajectory arrival rates until
NonShared saturates (offered utilization = QPS x NonShared's mean trajectory service time >= 1).
Prints p50/p90 TTFT per method per QPS, each method's realized rho and service times, and KVCMAS's
TTFT speedup over every other method at the highest QPS NonShared still sustains (utilization < 1)
beside the goal (>= 2x over NonShared), with KVCMAS's per-request breakdown (correction, anchor
construction, decode) when it falls short.

``--repeats N`` (default 1) measures the whole sweep N times, into ``--output-path``/repeat-1 ...
repeat-N, and ends with min / median / max over the repeats of each method's mean trajectory
service time and TTFT and of KVCMAS's speedups, with the spread (max - min) / median flagged
"SPREAD > 20%: not reproducible on this machine now" above 20%. The output starts with the command
line, date and git revision, and every output directory gets it appended to its ``command.txt``.

    python benchmarks/serve_sweep.py    # 2K shared, 12 trajectories (+ 2 calibration, 4 warm-up), 16 output
                                        # tokens, torch's default threads, 1 repeat, -o runs/serve-sweep-bench
    python benchmarks/serve_sweep.py --shared-tokens 256 --trajectories 2 --output-tokens 16   # smoke run
    OMP_NUM_THREADS=1 python benchmarks/serve_sweep.py ...   # or --threads 1, on a machine that is busy

Results (config, traces, service/requests JSONL, summary, plots, command.txt) go to --output-path;
re-running into it reuses the measurements.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Summary, append_header, fmt, print_header, spread_verdict, sweep_settings  # noqa: E402

METHODS = "nonshared,fullshared,kvcomm,graphflow,kvcmas"
UTILIZATIONS = "0.25,0.5,0.75,0.9,1.0"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shared-tokens", type=int, default=2048, help="non-generated shared context (default 2048)")
    ap.add_argument("--trajectories", type=int, default=12, help="evaluated trajectories (default 12)")
    ap.add_argument("--output-tokens", type=int, default=16, help="tokens generated per agent (default 16)")
    ap.add_argument(
        "--warmup-trajectories", type=int, default=4, help="held-out warm-up trajectories per method (default 4)"
    )
    ap.add_argument(
        "--calib-trajectories",
        type=int,
        default=2,
        help="held-out trajectories for calibration and warm-up (default 2)",
    )
    ap.add_argument("--methods", default=METHODS, help=f"comma-separated (default {METHODS})")
    ap.add_argument(
        "--utilizations",
        default=UTILIZATIONS,
        help="NonShared offered utilizations to sweep, QPS = u / NonShared trajectory service time; "
        f"values >= 1 end the sweep (default {UTILIZATIONS})",
    )
    ap.add_argument("--model", default=None, help="model (default: packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (default 0: torch's default, all cores or OMP_NUM_THREADS; on a busy "
        "machine use 1: 2 threads on a busy 2-core machine spin against each other and run many times slower)",
    )
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--matched-rho",
        default=None,
        help="serve at a matched reuse ratio: DELTA[,RECOMPUTE], or the paper's pairs paper-0.8 / paper-0.6",
    )
    ap.add_argument("--output-path", "-o", default="runs/serve-sweep-bench", help="default runs/serve-sweep-bench")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the whole sweep N times (into <output-path>/repeat-1 .. repeat-N when N > 1) and "
        "summarize the figures over them (default 1)",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch
    from rich.console import Console

    from kvcmas_bench.errors import BenchError

    if args.threads:
        torch.set_num_threads(args.threads)
    print_header(argv)
    console = Console()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    root = Path(args.output_path)
    outs = [root] if args.repeats == 1 else [root / f"repeat-{i}" for i in range(1, args.repeats + 1)]
    figures = []
    for i, out in enumerate(outs):
        if args.repeats > 1:
            console.print(f"\n[bold]repeat {i + 1} of {args.repeats}[/bold]: {out}")
        try:
            fig = one_sweep(args, argv, methods, out, console)
        except BenchError as exc:
            fig = str(exc)
        if isinstance(fig, str):
            print(f"serve_sweep: error: {fig}", file=sys.stderr)
            return 2
        figures.append(fig)
    if args.repeats > 1:
        append_header(root / "command.txt", argv)
        over_repeats(console, methods, figures)
    console.print(f"torch threads {torch.get_num_threads()}; {spread_verdict()}", soft_wrap=True)
    return 0


def one_sweep(args, argv, methods: list[str], out: Path, console) -> dict | str:
    """Measure, replay and print one sweep into ``out`` (its command appended to ``command.txt``);
    its headline figures, or an error line."""
    from kvcmas_bench.jobs.sweep import evaluate_service
    from kvcmas_bench.results.outdir import lock_output_dir

    t0 = time.perf_counter()
    single = measure(args, methods, out, console)
    measured_s = time.perf_counter() - t0
    rows = {r["method"]: r for r in single["rows"]}
    if "nonshared" not in rows:
        return "the QPS grid is derived from nonshared; include it in --methods"
    grid = qps_grid(args.utilizations, rows["nonshared"]["trajectory_service_mean_s"])
    summary = evaluate_service(str(out), [0.0] + grid, console=None)
    by = {(r["method"], r["qps"]): r for r in summary["rows"]}
    qps_all = sorted({r["qps"] for r in summary["rows"]})
    console.print(ttft_table(args, methods, by, qps_all))
    console.print(service_table(methods, by))
    fig: dict = {
        "service": {
            m: {k: by[(m, 0.0)][k] for k in ("trajectory_service_mean_s", "service_ttft_mean_s")} for m in methods
        },
        "speedup": None,
    }
    sustained = [q for q in qps_all if q > 0 and not by[("nonshared", q)]["saturated"]]
    if "kvcmas" in methods and sustained:
        fig.update(kvcmas_speedups(console, methods, by, max(sustained)))
        console.print(breakdown(out / "service.jsonl", methods))
    elif "kvcmas" in methods:
        console.print("no QPS below NonShared saturation in the grid; lower --utilizations")
    with lock_output_dir(out):  # the sweep is written; appended while no other process writes there
        append_header(out / "command.txt", argv)
    console.print(f"[dim]measurement {measured_s:.0f} s; results in {out}/ ({', '.join(summary['plots'])})[/dim]")
    return fig


def measure(args, methods: list[str], out: Path, console) -> dict:
    """Every method measured once, single stream, into ``out`` (``serve_sweep`` at QPS 0)."""
    from kvcmas_bench.jobs.sweep import SweepOptions, run_sweep

    opts = SweepOptions(
        methods=methods,
        qps=[0],
        shared_tokens=[args.shared_tokens],
        num_trajectories=args.trajectories,
        output_path=str(out),
        plots=False,
        show_table=False,
        **sweep_settings(args, "device", "burstiness"),
    )
    return run_sweep(opts, console=console)


def qps_grid(utilizations: str, t_ns: float) -> list[float]:
    """The QPS points (trajectories/s) of the comma-separated NonShared ``utilizations`` given NonShared's
    mean trajectory service time ``t_ns``, in increasing order, up to the first at which NonShared
    saturates (a utilization >= 1, appended at 1 when none is listed)."""
    grid: list[float] = []
    for u in sorted(float(u) for u in utilizations.split(",")):
        grid.append(u / t_ns * (1 + 1e-9 if u >= 1.0 else 1))  # float-safe: u = 1 must count as saturated
        if u >= 1.0:
            break
    else:  # always end on the first QPS at which NonShared saturates
        grid.append(1.0 / t_ns * (1 + 1e-9))
    return grid


def ttft_table(args, methods: list[str], by: dict, qps_all: list[float]):
    """p50 / p90 TTFT per QPS point and method, with NonShared's offered utilization."""
    from rich import box
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"p50 / p90 TTFT (s) at {args.shared_tokens} shared tokens, {args.trajectories} trajectories, "
        f"{args.output_tokens} output tokens; one-request-at-a-time FCFS server",
    )
    table.add_column("QPS (traj/s)", justify="right")
    table.add_column("util", justify="right")  # NonShared's offered utilization
    for m in methods:
        table.add_column(m, justify="right", min_width=len(m))  # wrap the cells, never cut the names
    for q in qps_all:
        u = by[("nonshared", q)]["utilization"]
        cells = [f"{by[(m, q)]['ttft_p50_s']:.3f} / {by[(m, q)]['ttft_p90_s']:.3f}" for m in methods]
        table.add_row("0 (single)" if q == 0 else f"{q:.3g}", "-" if u is None else f"{u:.2f}", *cells)
    return table


def service_table(methods: list[str], by: dict):
    """Each method measured in isolation (QPS 0): mean TTFT, E2E, trajectory time, rho and memory."""
    from rich.table import Table

    svc = Table(title="measured in isolation (mean per request) and memory")
    for col in ("method", "TTFT (s)", "E2E (s)", "trajectory (s)", "rho", "peak mem (MiB)", "KV+state (MiB)"):
        svc.add_column(col, justify="right" if col != "method" else "left")
    for m in methods:
        r = by[(m, 0.0)]
        svc.add_row(
            m,
            f"{r['service_ttft_mean_s']:.3f}",
            f"{r['service_e2e_mean_s']:.3f}",
            f"{r['trajectory_service_mean_s']:.3f}",
            "-" if r["reuse_ratio"] is None else f"{r['reuse_ratio']:.2f}",
            f"{(r['peak_mem_bytes'] or 0) / 2**20:.0f}",
            f"{r['kv_state_peak_bytes'] / 2**20:.1f}",
        )
    return svc


def kvcmas_speedups(console, methods: list[str], by: dict, q: float) -> dict:
    """KVCMAS's TTFT speedup over every other method at QPS ``q`` (printed); the figures' ``utilization``
    (NonShared's at ``q``) and ``speedup`` (method -> (p50, p90) ratio other / KVCMAS)."""
    k = by[("kvcmas", q)]
    fig: dict = {"utilization": by[("nonshared", q)]["utilization"], "speedup": {}}
    console.print(
        f"KVCMAS TTFT speedup (other / KVCMAS) at QPS {q:.3g}, the highest NonShared sustains "
        f"(utilization {fig['utilization']:.2f}):"
    )
    for m in methods:
        if m == "kvcmas":
            continue
        o = by[(m, q)]
        fig["speedup"][m] = (o["ttft_p50_s"] / k["ttft_p50_s"], o["ttft_p90_s"] / k["ttft_p90_s"])
        goal = "  (goal >= 2x)" if m == "nonshared" else ""
        console.print(f"  vs {m:<12} p50 {fig['speedup'][m][0]:.2f}x   p90 {fig['speedup'][m][1]:.2f}x{goal}")
    return fig


def over_repeats(console, methods: list[str], figures: list[dict]) -> None:
    """min / median / max over the repeats of the figures the sweep's conclusions rest on."""
    n = len(figures)
    console.print(f"\n[bold]over {n} repeats[/bold] (min / median / max; spread = (max - min) / median)")
    for key, label in (("trajectory_service_mean_s", "mean trajectory service"), ("service_ttft_mean_s", "mean TTFT")):
        console.print(f"  {label} (s), measured in isolation:")
        for m in methods:
            console.print(
                f"    {m:<12} {fmt(Summary.of(f['service'][m][key] for f in figures))}", highlight=False, soft_wrap=True
            )
    with_speedup = [f for f in figures if f["speedup"] is not None]
    if "kvcmas" not in methods:
        return
    if len(with_speedup) < n:
        console.print(f"  KVCMAS speedups: {n - len(with_speedup)} of {n} repeats had no QPS NonShared sustains")
    if not with_speedup:
        return
    console.print("  KVCMAS TTFT speedup (other / KVCMAS) at the highest QPS NonShared sustains in each repeat:")
    for m in methods:
        if m == "kvcmas":
            continue
        for i, p in enumerate(("p50", "p90")):
            s = Summary.of(f["speedup"][m][i] for f in with_speedup)
            console.print(f"    vs {m:<12} {p} {fmt(s, 'x', 2)}", highlight=False, soft_wrap=True)


def breakdown(service_path: Path, methods: list[str]):
    """Per-request means from the measurements: where each method's service time goes."""
    import json

    from rich.table import Table

    from kvcmas_bench.results.request import RequestRecord

    recs = [RequestRecord.from_dict(json.loads(x)) for x in service_path.read_text().splitlines() if x.strip()]
    t = Table(title="per request, measured in isolation (means, s): where the service time goes")
    for col in ("method", "TTFT", "correction", "anchors", "decode", "E2E", "accepted"):
        t.add_column(col, justify="right" if col != "method" else "left")
    for m in methods:
        mine = [r for r in recs if r.method == m]
        if not mine:
            continue
        n = len(mine)
        corr = sum(s.materialize_s or 0.0 for r in mine for s in r.shared_segments if s.status == "corrected") / n
        anchors = sum(r.deferred_s or 0.0 for r in mine) / n
        ttft = sum(r.ttft_s for r in mine) / n
        e2e = sum(r.e2e_s for r in mine) / n
        shared = [s for r in mine for s in r.shared_segments if s.eligible]
        acc = sum(s.status == "corrected" for s in shared)
        t.add_row(
            m,
            f"{ttft:.3f}",
            f"{corr:.3f}",
            f"{anchors:.3f}",
            f"{e2e - ttft - anchors:.3f}",
            f"{e2e:.3f}",
            f"{acc}/{len(shared)}" if shared else "-",
        )
    return t


if __name__ == "__main__":
    sys.exit(main())
