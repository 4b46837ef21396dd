import sys
from pathlib import Path
import pandas as pd
from kvcmas_bench.results.figures import canonical
from kvcmas_bench.report.plots import pareto_axes, meta_line
from kvcmas_bench.report.figcheck import figure_problems
df = pd.read_csv("/work/main/benchmarks/results/table1/table1.csv")
df = df.rename(columns={"latency_s": "latency_mean_s", "ttft_s": "ttft_mean_s"})
meta = meta_line(df) + "; bars: 95% Wilson interval"
fig, _ = pareto_axes(df, "ttft_mean_s", "answer_agreement", f"mmlu: answer agreement with NonShared vs TTFT\n{meta}")
print("\n".join(figure_problems(fig)) or "clean")
fig.savefig(sys.argv[1], dpi=120)
