#!/usr/bin/env python
"""Serving benchmark on vLLM next to the in-process engine, on the same traces.

For every shared-context length: the in-process engine measures every method once on controlled
four-agent traces (single stream) and saves the traces, then replays them on its one-request-at-a-time
FCFS server at ``--qps-factors`` x its NonShared capacity (1 / NonShared trajectory service time).
``serve-sweep --engine vllm`` serves the same traces for real through one ``vllm serve`` with the
connector, started once for the whole run (continuous batching, Poisson arrivals on the wall clock,
the harness as HTTP client) at the same factors x *vLLM's*
single-stream NonShared rate (measured first, NonShared only): the engines differ several-fold in
speed, so one QPS grid cannot load both. Prints p50/p90 TTFT per engine, method and QPS, and the
TTFT ratios NonShared / method at the highest QPS NonShared sustains on each engine (in-process:
utilization < 1; vLLM: trajectories complete as fast as they arrive, drain ratio <= 1.25). Then,
per shared length and method, the vLLM worker's memory over the sweep (from the session report
after every QPS point, kept in the vLLM sweep's ``config.json``): the peak of the K/V it held, the
bytes each trajectory held when its last agent finished, and whether every trajectory was freed
(no live trajectory at any report).

Run it with a Python that has vLLM (``bash scripts/setup.sh --vllm``), one thread per engine
(torch threads = ``OMP_NUM_THREADS``, default 1):

    OMP_NUM_THREADS=1 python benchmarks/serve_sweep_vllm.py --shared-tokens 1024,2048 --trajectories 12 \\
        --warmup-trajectories 4 --output-tokens 16 --calib-trajectories 2 --qps-factors 0.5,0.9,1.5,2 \\
        -o runs/vllm-bench   # the defaults
    ... --matched-rho paper-0.8   # both engines at the paper's matched reuse ratio (Section 4.3, B.4)

Results: ``-o``/``<shared>/in-process`` and ``-o``/``<shared>/vllm`` (ordinary serve-sweep
directories: config, traces, requests, summary, plots), ``-o``/``comparison.json`` (first keys:
``command``, ``date``, ``git``, ``machine``; then ``results`` and ``worker_memory``) and ``-o``/``command.txt`` (the
header of every measuring run, appended). The printed output starts with the same header.

``--repeats N`` (default 1) measures everything N times, into ``-o``/repeat-1 ... repeat-N (each laid
out as above), and ends with min / median / max over the repeats of every TTFT ratio, with the
spread (max - min) / median flagged "SPREAD > 20%: not reproducible on this machine now" above
20%; ``-o``/comparison.json then holds ``repeats`` (each repeat's results) and ``summary``.
``--report-only`` re-reads ``-o`` (its repeat-* directories when there are any).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Summary,
    append_header,
    fmt,
    print_header,
    provenance,
    spread_verdict,
    sweep_settings,
)

METHODS = "nonshared,fullshared,kvcmas,kvcomm,graphflow"


def _table(console, shared: int, grids: dict, methods: list[str]) -> None:
    from rich.table import Table

    t = Table(title=f"p50 / p90 TTFT (s) at {shared} shared tokens ('!' = saturated)")
    t.add_column("engine")
    t.add_column("QPS", justify="right")
    for m in methods:
        t.add_column(m, justify="right")
    for engine, by in grids.items():
        for q in sorted({k[1] for k in by}):
            cells = []
            for m in methods:
                r = by[(m, q)]
                mark = "!" if r["saturated"] else ""
                cells.append(f"{r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f}{mark}")
            t.add_row(engine, "0 (single)" if q == 0 else f"{q:.3g}", *cells)
    console.print(t)


def rows_of(sweep_dir: Path) -> dict:
    """(method, qps) -> summary row, recomputed from ``requests.jsonl`` with the current metrics
    (so ``--report-only`` re-reads an older run with today's saturation rule)."""
    from kvcmas_bench.results.request import RequestRecord
    from kvcmas_bench.results.stats import percentile
    from kvcmas_bench.serving.metrics import mark_saturation, reuse_work_s, sweep_row

    groups: dict = {}
    for line in (sweep_dir / "requests.jsonl").read_text().splitlines():
        r = RequestRecord.from_dict(json.loads(line))
        groups.setdefault((r.method, r.shared_tokens, r.qps), []).append(r)
    rows = []
    for (m, s, q), recs in groups.items():
        row = sweep_row(m, s, q, recs)
        row["work_mean_s"] = sum(reuse_work_s(r) for r in recs) / len(recs)  # on vLLM: in the worker
        waits = [r.plan_wait_s for r in recs if r.plan_wait_s is not None]  # vLLM runs since the field exists
        row["plan_wait_p50_s"], row["plan_wait_p90_s"] = percentile(waits, 50), percentile(waits, 90)
        rows.append(row)
    mark_saturation(rows)
    return {(r["method"], r["qps"]): r for r in rows}


def ratios(by: dict, methods: list[str]) -> dict | None:
    """NonShared / method p50 and p90 TTFT at the highest QPS > 0 where NonShared is not saturated."""
    stable = [q for (m, q), r in by.items() if m == "nonshared" and q > 0 and not r["saturated"]]
    if not stable:
        return None
    q = max(stable)
    ns = by[("nonshared", q)]
    out = {"qps": q}
    for m in methods:
        r = by[(m, q)]
        out[m] = {
            "p50_s": r["ttft_p50_s"],
            "p90_s": r["ttft_p90_s"],
            "p50_ratio": ns["ttft_p50_s"] / r["ttft_p50_s"],
            "p90_ratio": ns["ttft_p90_s"] / r["ttft_p90_s"],
            "reuse_ratio": r.get("reuse_ratio"),
            "dense_fallback_share": r.get("dense_fallback_share"),
            "work_mean_s": r.get("work_mean_s"),
        }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shared-tokens", default="1024,2048", help="comma-separated context lengths (default 1024,2048)")
    ap.add_argument("--trajectories", type=int, default=12, help="measured trajectories (default 12)")
    ap.add_argument(
        "--warmup-trajectories", type=int, default=4, help="held-out warm-up trajectories per method (default 4)"
    )
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--calib-trajectories", type=int, default=2)
    ap.add_argument("--methods", default=METHODS, help=f"comma-separated, NonShared included (default {METHODS})")
    ap.add_argument(
        "--qps-factors",
        default="0.5,0.9,1.5,2",
        help="QPS grid as multiples of each engine's single-stream NonShared rate (default 0.5,0.9,1.5,2)",
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-arg", action="append", default=[], help="vLLM engine option KEY=VALUE (repeatable)")
    ap.add_argument(
        "--matched-rho",
        default=None,
        help="serve both engines at a matched reuse ratio: DELTA[,RECOMPUTE], or the paper's pairs paper-0.8 / "
        "paper-0.6 (default: none, every method's own gate)",
    )
    ap.add_argument("--output-path", "-o", default="runs/vllm-bench")
    ap.add_argument("--report-only", action="store_true", help="print the tables of an existing --output-path")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure everything N times (into <output-path>/repeat-1 .. repeat-N when N > 1) and summarize "
        "the TTFT ratios over them (default 1)",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


@dataclass
class Bench:
    """One invocation: its options, the methods, shared lengths, QPS factors and vLLM engine options."""

    args: argparse.Namespace
    argv: list[str] | None
    console: Any
    methods: list[str]
    lengths: list[int] = field(default_factory=list)
    factors: list[float] = field(default_factory=list)
    engine_options: dict = field(default_factory=dict)

    def parse_lists(self) -> None:
        self.lengths = [int(x) for x in self.args.shared_tokens.split(",") if x.strip()]
        self.factors = [float(x) for x in self.args.qps_factors.split(",") if x.strip()]
        self.engine_options = dict(kv.split("=", 1) for kv in self.args.engine_arg)

    @property
    def root(self) -> Path:
        return Path(self.args.output_path)

    def roots(self) -> list[Path]:
        """The measurement directories: ``--report-only`` reads the repeat-* ones there are (else the
        root); a run measures into the root, or repeat-1 .. repeat-N."""
        root, args = self.root, self.args
        if args.report_only:
            found = [p for p in root.glob("repeat-*") if p.name[len("repeat-") :].isdigit()]
            return sorted(found, key=lambda p: int(p.name[len("repeat-") :])) or [root]
        return [root] if args.repeats == 1 else [root / f"repeat-{i}" for i in range(1, args.repeats + 1)]

    def sweep_options(self) -> dict:
        """The ``SweepOptions`` settings both engines' sweeps share."""
        return dict(show_table=False, **sweep_settings(self.args))


def refusal(args: argparse.Namespace, methods: list[str]) -> str | None:
    """Why this run cannot go ahead (checked before anything is measured), or None."""
    from kvcmas_bench.errors import BenchError

    if "nonshared" not in methods:
        return "include nonshared (the reference)"
    if not args.report_only:  # before the in-process half runs: a method the server cannot serve fails now
        import kvcmas_bench.serving.vllm  # noqa: F401  (registers the engine and its limits)
        from kvcmas_bench.methods import method_class
        from kvcmas_bench.serving.engines import check_engine

        try:
            check_engine("vllm", [method_class(m) for m in methods])
        except BenchError as exc:
            return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch
    from rich.console import Console

    from kvcmas_bench.errors import BenchError

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print_header(argv)
    console = Console(width=max(100, Console().width))
    b = Bench(args, argv, console, [m.strip() for m in args.methods.split(",") if m.strip()])
    why = refusal(args, b.methods)
    if why is not None:
        print(f"serve_sweep_vllm: error: {why}", file=sys.stderr)
        return 2
    b.parse_lists()
    roots = b.roots()
    every: list[dict] = []
    for i, r in enumerate(roots):
        if len(roots) > 1:
            console.print(f"\n[bold]repeat {i + 1} of {len(roots)}[/bold]: {r}")
        try:
            every.append(measure_and_report(b, r))
        except BenchError as exc:
            print(f"serve_sweep_vllm: error: {exc}", file=sys.stderr)
            return 2
    if len(roots) > 1:
        if not args.report_only:
            append_header(b.root / "command.txt", argv)
        summary = over_repeats(console, b.lengths, b.methods, every)
        write_comparison(b.root / "comparison.json", argv, {"repeats": every, "summary": summary})
    console.print(f"torch threads {torch.get_num_threads()}; {spread_verdict()}", soft_wrap=True)
    return 0


def measure_and_report(b: Bench, r: Path) -> dict:
    """One measurement under ``r`` (unless ``--report-only``), its sections printed and its
    ``comparison.json`` written; the TTFT ratios per length and engine."""
    if not b.args.report_only:
        run_all(b.args, b.methods, b.lengths, b.factors, b.engine_options, r, b.sweep_options(), b.console)
        append_header(r / "command.txt", b.argv)
    results = report(b.console, r, b.lengths, b.methods)
    memory = worker_memory(b.console, r, b.lengths, b.methods)
    thread = method_thread(b.console, r, b.lengths, b.methods)
    clocks = client_vs_server(b.console, r, b.lengths, b.methods)
    write_comparison(
        r / "comparison.json",
        b.argv,
        {"results": results, "worker_memory": memory, "method_thread": thread, "client_vs_server_ttft": clocks},
    )
    return results


def report(console, root: Path, lengths: list[int], methods: list[str]) -> dict:
    """Print the tables and ratios of one measurement under ``root``; the ratios per length and engine."""
    from kvcmas_bench.errors import BenchError

    results: dict = {}
    for s in lengths:
        by_engine = {}
        for engine in ("in-process", "vllm"):
            if not (root / str(s) / engine / "requests.jsonl").is_file():
                raise BenchError(f"{root / str(s) / engine} holds no requests.jsonl (run without --report-only)")
            by_engine[engine] = rows_of(root / str(s) / engine)
        _table(console, s, by_engine, methods)
        results[s] = {e: ratios(by, methods) for e, by in by_engine.items()}
    console.print("TTFT ratio NonShared / method at the highest QPS NonShared sustains (> 1: faster than NonShared)")
    for s, per in results.items():
        for engine, r in per.items():
            if r is None:
                console.print(f"  {s:>5} shared, {engine:<10}: NonShared saturated at every QPS > 0 swept")
                continue
            cells = "  ".join(f"{m} p50 {r[m]['p50_ratio']:.2f}x p90 {r[m]['p90_ratio']:.2f}x" for m in methods[1:])
            console.print(f"  {s:>5} shared, {engine:<10} at QPS {r['qps']:.3g}: {cells}")
    console.print(
        "At that QPS, per method: realized rho, share of requests with a dense fallback, and the mean reuse "
        "work per request (materializing the shared segments served from a reused cache: gate, correction, "
        "alignment)"
    )
    for s, per in results.items():
        for engine, r in per.items():
            if r is None:
                continue
            cells = "  ".join(
                f"{m} rho {_fmt(r[m]['reuse_ratio'])} fallback {_fmt(r[m]['dense_fallback_share'])} "
                f"work {_fmt(r[m]['work_mean_s'], '.3f')} s"
                for m in methods
            )
            console.print(f"  {s:>5} shared, {engine:<10}: {cells}")
    return results


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def worker_reports(root: Path, shared: int) -> tuple[Path, list | None]:
    """The vLLM sweep's ``config.json`` at one shared length and its worker reports (one per QPS
    point; None when the file or the figures are missing)."""
    cfg_path = root / str(shared) / "vllm" / "config.json"
    if not cfg_path.is_file():
        return cfg_path, None
    return cfg_path, json.loads(cfg_path.read_text()).get("backend_config", {}).get("worker_reports")


def reports_with(console, root: Path, lengths: list[int], present, what: str, why: str = ""):
    """``(shared length, its worker reports)`` for each length whose reports hold the figures
    (``present(points)``); a line saying there are no ``what`` figures (``why``) for the others."""
    for s in lengths:
        cfg_path, points = worker_reports(root, s)
        if not points or not present(points):
            console.print(f"  {s:>5} shared: no {what} figures in {cfg_path}{why}")
            continue
        yield s, points


def _per_request(p: dict, prev: dict, prefix: str, n: int) -> dict[str, float]:
    """A worker report's ``<prefix><kind>_s`` figures over one point (minus the previous report), per request."""
    return {
        k[len(prefix) : -len("_s")]: (p[k] - prev.get(k, 0.0)) / n
        for k in sorted(p)
        if k.startswith(prefix) and k.endswith("_s") and k != prefix + "s" and p[k] is not None
    }


def method_thread(console, root: Path, lengths: list[int], methods: list[str]) -> dict:
    """Per shared length, method and QPS point > 0, the busy seconds of the vLLM worker's method
    thread during the point (every job it ran: planning, gate and correction, chaining, anchor
    updates after dense fallbacks, records), per request and as a share of the point's makespan.
    The worker's ``method_work_s`` is cumulative over the server's life; a point's figure is its
    report's minus the previous report's (a method's first point, QPS 0, also holds its warm-up, so
    it is not printed). The thread runs its jobs one at a time, plans first (``worker.Jobs``); a
    request's plan wait (p50/p90, from its record) is the time the thread spent on other jobs
    after the worker heard of it (runs before the field existed print "-"). Per request, the busy
    seconds are also split by kind of job (plan, first_token, finish, report) where the worker
    reports them (``method_work_<kind>_s``), each with the thread's CPU seconds for it where
    reported (``method_cpu_<kind>_s``; the rest of the busy time waited for a core or the GIL)."""
    console.print(
        "vLLM worker's method thread at each QPS point > 0: busy seconds (all its jobs), per request, and as a "
        "share of the point's makespan; requests' plan wait p50/p90"
    )
    out: dict = {}
    has_work = lambda points: all(p.get("method_work_s") is not None for p in points)  # noqa: E731
    for s, points in reports_with(console, root, lengths, has_work, "method-thread"):
        rows = rows_of(root / str(s) / "vllm")
        for prev, p in zip(points, points[1:]):
            if p["method"] not in methods or not p["qps"] or (p["method"], p["qps"]) not in rows:
                continue
            row = rows[(p["method"], p["qps"])]
            busy = p["method_work_s"] - prev["method_work_s"]
            fig = {
                "busy_s": busy,
                "per_request_s": busy / row["n_requests"],
                "busy_share": busy / row["makespan_s"] if row["makespan_s"] else None,
                "plan_wait_p50_s": row.get("plan_wait_p50_s"),
                "plan_wait_p90_s": row.get("plan_wait_p90_s"),
            }
            kinds = _per_request(p, prev, "method_work_", row["n_requests"])
            cpu = _per_request(p, prev, "method_cpu_", row["n_requests"])
            fig["per_request_by_kind_s"] = kinds
            if cpu:
                fig["per_request_cpu_by_kind_s"] = cpu
            out.setdefault(str(s), {}).setdefault(p["method"], {})[str(p["qps"])] = fig
            split = ", ".join(
                f"{k} {v:.3f}" + (f" (cpu {cpu[k]:.3f})" if k in cpu and v > 0 else "") for k, v in kinds.items()
            )
            console.print(
                f"  {s:>5} shared, {p['method']:<12} QPS {p['qps']:.3g}: busy {busy:.2f} s, "
                f"{fig['per_request_s']:.3f} s per request{f' ({split})' if split else ''}, "
                f"{_fmt(fig['busy_share'], '.0%')} of the makespan; "
                f"plan wait {_fmt(fig['plan_wait_p50_s'], '.3f')} / {_fmt(fig['plan_wait_p90_s'], '.3f')} s"
            )
    return out


def client_vs_server(console, root: Path, lengths: list[int], methods: list[str]) -> dict:
    """Per shared length, method and QPS point, the client's mean TTFT from sending a request to
    its first streamed token beside vLLM's own mean (its ``time_to_first_token_seconds`` histogram
    over the point, from ``/metrics``), and their difference: what the HTTP hop, the frontend's
    hand-offs and the client's reading add to the client's figure. "-" where the server counted
    other requests in the point too (context-free reference captures) or had no ``/metrics``."""
    console.print(
        "Client vs server TTFT at each QPS point: mean send-to-first-token on the client, vLLM's own mean "
        "(/metrics), and their difference"
    )
    out: dict = {}
    has_ttft = lambda points: any(p.get("client_ttft_mean_s") is not None for p in points)  # noqa: E731
    for s, points in reports_with(console, root, lengths, has_ttft, "client/server TTFT"):
        for p in points:
            if p["method"] not in methods or "client_ttft_mean_s" not in p:
                continue
            fig = {k: p.get(k) for k in ("client_ttft_mean_s", "server_ttft_mean_s", "server_ttft_count")}
            fig["client_minus_server_s"] = p.get("client_minus_server_ttft_s")
            out.setdefault(str(s), {}).setdefault(p["method"], {})[str(p["qps"])] = fig
            qps = "0 (single)" if not p["qps"] else f"{p['qps']:.3g}"
            console.print(
                f"  {s:>5} shared, {p['method']:<12} QPS {qps}: client {_fmt(fig['client_ttft_mean_s'], '.3f')} s, "
                f"server {_fmt(fig['server_ttft_mean_s'], '.3f')} s ({fig['server_ttft_count']} requests), "
                f"difference {_fmt(fig['client_minus_server_s'], '.4f')} s"
            )
    return out


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def worker_memory(console, root: Path, lengths: list[int], methods: list[str]) -> dict:
    """Per shared length and method, the vLLM worker's memory over its QPS points (printed and
    returned): the peak K/V held (every session's sources, references and system prompts; rank 0's
    under tensor parallelism), the bytes per trajectory when its last agent finished (max, and mean
    over every completed trajectory), and the live trajectories at each report (0: all freed)."""
    console.print(
        "vLLM worker memory over the sweep: peak K/V held, per trajectory at completion (max / mean), "
        "live trajectories at each QPS point's report (0 = freed), K/V still held after a point (system prompts; "
        "context-free references are dropped at each report since 6fc7b14)"
    )
    out: dict = {}
    for s, points in reports_with(console, root, lengths, bool, "worker", " (measured before they were recorded)"):
        for m in methods:
            got = [p for p in points if p["method"] == m]
            if not got:
                continue
            done = [p for p in got if p.get("trajectories_completed")]
            n = sum(p["trajectories_completed"] for p in done)
            row = {
                "held_peak_bytes": max(p["held_peak_bytes"] for p in got),
                # what stays after a point: system prompts (and, before 6fc7b14, context-free references)
                "held_after_bytes": max(p["held_bytes"] for p in got),
                "trajectory_bytes_at_completion_max": max(
                    (p["trajectory_bytes_at_completion_max"] for p in done), default=None
                ),
                "trajectory_bytes_at_completion_mean": (
                    sum(p["trajectory_bytes_at_completion_mean"] * p["trajectories_completed"] for p in done) / n
                    if n
                    else None
                ),
                "trajectories_completed": n,
                "live_trajectories": {str(p["qps"]): p["live_trajectories"] for p in got},
            }
            row["freed"] = all(v == 0 for v in row["live_trajectories"].values())
            out.setdefault(str(s), {})[m] = row
            live = ",".join(str(v) for v in row["live_trajectories"].values())
            console.print(
                f"  {s:>5} shared, {m:<12} peak held {_mib(row['held_peak_bytes'])}; per trajectory at completion "
                f"{_mib(row['trajectory_bytes_at_completion_max'])} max / "
                f"{_mib(row['trajectory_bytes_at_completion_mean'])} mean ({n} trajectories); "
                f"live at each of {len(got)} reports: {live} "
                + ("(freed)" if row["freed"] else "(NOT freed)")
                + f"; held after a point {_mib(row['held_after_bytes'])}",
                highlight=False,
                soft_wrap=True,
            )
    return out


def over_repeats(console, lengths: list[int], methods: list[str], every: list[dict]) -> dict:
    """min / median / max over the repeats of every TTFT ratio NonShared / method (printed and returned)."""
    n = len(every)
    console.print(
        f"\n[bold]over {n} repeats[/bold]: TTFT ratio NonShared / method at the highest QPS NonShared sustains "
        "(min / median / max; spread = (max - min) / median)"
    )
    out: dict = {}
    for s in lengths:
        for engine in ("in-process", "vllm"):
            got = [res[s][engine] for res in every if res[s][engine] is not None]
            if len(got) < n:
                console.print(f"  {s:>5} shared, {engine}: NonShared saturated at every QPS in {n - len(got)} of {n}")
            if not got:
                continue
            for m in methods[1:]:
                for p in ("p50", "p90"):
                    sm = Summary.of(r[m][f"{p}_ratio"] for r in got)
                    out.setdefault(str(s), {}).setdefault(engine, {}).setdefault(m, {})[f"{p}_ratio"] = sm.as_dict()
                    console.print(
                        f"  {s:>5} shared, {engine:<10} {m:<12} {p} {fmt(sm, 'x', 2)}", highlight=False, soft_wrap=True
                    )
    return out


def write_comparison(path: Path, argv, body: dict) -> None:
    """``comparison.json``: the command, date, git revision and machine first, then ``body``."""
    path.write_text(json.dumps({**provenance(argv), **body}, indent=1))


def run_all(args, methods, lengths, factors, engine_options, root: Path, common: dict, console) -> None:
    """The in-process measurements and replays, then one ``vllm serve`` with the connector (unless
    ``--engine-arg base_url=`` names a running one) for the vLLM single-stream probe and sweep."""
    from kvcmas_bench.jobs.sweep import SweepOptions, evaluate_service, run_sweep

    def sweep(methods, qps, s, out, **kw):
        opts = SweepOptions(
            methods=methods, qps=qps, shared_tokens=[s], num_trajectories=args.trajectories, output_path=str(out), **kw
        )
        return run_sweep(opts, console=console, progress=lambda msg: console.print(f"[dim]{msg}[/dim]"))

    grids: dict[int, list[float]] = {}
    for s in lengths:  # the in-process engine first, alone on the machine
        d = root / str(s) / "in-process"
        single = sweep(methods, [0], s, d, device="cpu", plots=False, **common)
        t_ns = next(r for r in single["rows"] if r["method"] == "nonshared")["trajectory_service_mean_s"]
        grids[s] = [round(f / t_ns, 4) for f in factors]
        evaluate_service(str(d), [0.0] + grids[s], console=None)
    server, engine_options = start_server(args, engine_options, console)
    try:
        for s in lengths:
            t0 = time.perf_counter()
            # the probe and the sweep: the in-process engine's traces at this length, on the server
            on_vllm = functools.partial(
                sweep,
                s=s,
                traces_path=str(root / str(s) / "in-process" / "traces.jsonl"),
                engine="vllm",
                engine_options=engine_options,
                **common,
            )
            probe = on_vllm(["nonshared"], [0], out=root / str(s) / "vllm-single-stream", plots=False)
            t_ns = next(r for r in probe["rows"] if r["method"] == "nonshared")
            # a single stream's makespan is the sum of the trajectories' latencies
            rate = t_ns["n_trajectories"] / t_ns["makespan_s"]
            on_vllm(methods, [0.0] + [round(f * rate, 4) for f in factors], out=root / str(s) / "vllm")
            console.print(f"[dim]vLLM sweep at {s} shared tokens: {time.perf_counter() - t0:.0f} s[/dim]")
    finally:
        if server is not None:
            server.stop()


def start_server(args, engine_options: dict, console):
    """One ``vllm serve`` with the connector for the whole benchmark; the client options to reach it."""
    if engine_options.get("base_url"):
        return None, engine_options
    from kvcmas_bench.serving.vllm.http import Server, ServerOptions, _free_port, serve_command
    from kvcmas_bench.serving.vllm.inprocess import _resolve_model

    opts = ServerOptions.parse(engine_options)
    path, _ = _resolve_model(args.model)
    port = _free_port()
    cmd = serve_command(path, port, args.dtype, opts, cpu=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(opts.kv_cache_gib)}
    t0 = time.perf_counter()
    server = Server(cmd, env, port, opts.startup_timeout)
    console.print(f"[dim]vllm serve up in {time.perf_counter() - t0:.0f} s on port {port}: {' '.join(cmd)}[/dim]")
    client = {k: v for k, v in engine_options.items() if k in ("stop_at_first_token",)}
    return server, {**client, "base_url": f"http://127.0.0.1:{port}"}


if __name__ == "__main__":
    sys.exit(main())
