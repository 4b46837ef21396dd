import sys
import pandas as pd
from kvcmas_bench.report.plots import pareto_axes, rho_axes
from kvcmas_bench.report.figcheck import figure_problems

def frame():
    rows = []
    # crowded: 6 methods within a tiny region, wide intervals, one extreme point, ties
    spec = [("nonshared", 2.0, 0.5), ("fullshared", 1.0, 0.333), ("kvcmas", 1.2, 0.5), ("kvcomm", 1.21, 0.5),
            ("graphflow", 1.19, 0.5), ("cacheblend", 1.22, 0.333), ("droidspeak", 1.2, 0.333),
            ("relaycaching", 1.21, 0.333), ("kvcmas-nonchained", 1.2, 0.0)]
    for m, x, y in spec:
        rows.append({"method": m, "label": m, "ttft_mean_s": x, "latency_mean_s": 10 * x, "accuracy": y,
                     "accuracy_ci_low": max(0.0, y - 0.35), "accuracy_ci_high": min(1.0, y + 0.35),
                     "model": "SmolLM2-135M-Instruct", "device": "cpu", "prompt_tokens_mean": 300, "prompt_tokens_max": 400})
    return pd.DataFrame(rows)

title = "mmlu: accuracy vs TTFT\nSmolLM2-135M-Instruct on cpu; context: prompt 300 tokens mean, 400 max; bars: 95% Wilson interval and a long tail to wrap"
fig, ax = pareto_axes(frame(), "ttft_mean_s", "accuracy", title)
print("\n".join(figure_problems(fig)) or "clean")
fig.savefig(sys.argv[1], dpi=120)
