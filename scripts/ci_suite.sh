#!/usr/bin/env bash
# The tiny deterministic suite of the CI regression check (real default model, CPU, greedy):
# 3 MMLU samples, NonShared / FullShared / KVCMAS, with fidelity. Usage: bash scripts/ci_suite.sh OUTDIR
# Shared by scripts/regression.sh (CI) and scripts/refresh_baseline.sh, so the two cannot drift.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: bash scripts/ci_suite.sh OUTDIR}
PY=${PY:-.venv/bin/python}
# one intra-op thread: the same float reduction order whatever the machine's core count
export OMP_NUM_THREADS=1
rm -rf "$OUTDIR"
"$PY" -m kvcmas_bench.cli suite --methods nonshared,fullshared,kvcmas --workloads mmlu --limit 3 --seed 0 \
    --max-new-tokens 8 --final-max-new-tokens 4 --fidelity --device cpu --dtype float32 -o "$OUTDIR"
