"""Redraw the before/after pair of this folder with the checked-out code (issue 49):
``python docs/figures/legibility/redraw.py OUT_DIR`` writes crowded_wide_intervals.png (nine
methods crowded at TTFT 1.2 s with wide 95% intervals) and table1_agreement_vs_ttft.png (from
benchmarks/results/table1/table1.csv), and prints what ``report.figcheck`` finds in each."""

import sys
from pathlib import Path

import pandas as pd

from kvcmas_bench.report.figcheck import figure_problems
from kvcmas_bench.report.plots import meta_line, pareto_axes

ROOT = Path(__file__).resolve().parents[3]
CROWD = [
    ("nonshared", 2.0, 0.5),
    ("fullshared", 1.0, 0.333),
    ("kvcmas", 1.2, 0.5),
    ("kvcomm", 1.21, 0.5),
    ("graphflow", 1.19, 0.5),
    ("cacheblend", 1.22, 0.333),
    ("droidspeak", 1.2, 0.333),
    ("relaycaching", 1.21, 0.333),
    ("kvcmas-nonchained", 1.2, 0.0),
]


def crowded() -> pd.DataFrame:
    rows = []
    for m, x, y in CROWD:
        rows.append(
            {
                "method": m,
                "label": m,
                "ttft_mean_s": x,
                "latency_mean_s": 10 * x,
                "accuracy": y,
                "accuracy_ci_low": max(0.0, y - 0.35),
                "accuracy_ci_high": min(1.0, y + 0.35),
                "model": "SmolLM2-135M-Instruct",
                "device": "cpu",
                "prompt_tokens_mean": 300,
                "prompt_tokens_max": 400,
            }
        )
    return pd.DataFrame(rows)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    df = crowded()
    fig, _ = pareto_axes(df, "ttft_mean_s", "accuracy", f"mmlu: accuracy vs TTFT\n{meta_line(df)}")
    print("crowded:", figure_problems(fig) or "clean")
    fig.savefig(out / "crowded_wide_intervals.png", dpi=120)
    t1 = pd.read_csv(ROOT / "benchmarks/results/table1/table1.csv")
    t1 = t1.rename(columns={"latency_s": "latency_mean_s", "ttft_s": "ttft_mean_s"})
    title = f"mmlu: answer agreement with NonShared vs TTFT\n{meta_line(t1)}; bars: 95% Wilson interval"
    fig, _ = pareto_axes(t1, "ttft_mean_s", "answer_agreement", title)
    print("table1:", figure_problems(fig) or "clean")
    fig.savefig(out / "table1_agreement_vs_ttft.png", dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
