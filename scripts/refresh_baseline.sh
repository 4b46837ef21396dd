#!/usr/bin/env bash
# Refresh the CI regression baseline on purpose (after a change that is meant to change results):
# run the CI suite and store a compact copy in benchmarks/baselines/ci-suite. Review and commit it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=runs/ci-regression
bash scripts/ci_suite.sh "$OUT/suite"
"$PY" -c "import sys; from kvcmas_bench.jobs.compare import write_baseline; write_baseline(sys.argv[1], sys.argv[2])" \
    "$OUT/suite" benchmarks/baselines/ci-suite
echo "baseline refreshed: review 'git diff --stat benchmarks/baselines' and commit it"
