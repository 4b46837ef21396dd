#!/usr/bin/env bash
# CI regression check: run the tiny deterministic suite and compare it with the baseline committed
# under benchmarks/baselines/ci-suite. Exit 1 when a deterministic value changed (predictions, first
# tokens, outputs, token counts, segment statuses, rho, state bytes, fidelity within 1e-3), 2 when
# the inputs are unusable. Timings are not compared (CI machines differ). The Markdown report is
# written to runs/ci-regression/compare.md. A change on purpose: bash scripts/refresh_baseline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=runs/ci-regression
bash scripts/ci_suite.sh "$OUT/suite"
# every figure the suite's report drew passes the legibility check (report.figcheck); a problem is
# listed in the report's introduction as "figure NAME: ..."
if grep -n "^- figure " "$OUT/suite/report/report.md"; then
    echo "FAIL: a figure of the CI suite's report is not legible (above)" >&2
    exit 1
fi
# the HTML report as a reader opens it: headless Chromium, every image loaded, no sideways scrolling
PY="$PY" bash scripts/check_html.sh "$OUT/suite/report/report.html"
"$PY" -m kvcmas_bench.cli compare benchmarks/baselines/ci-suite "$OUT/suite" --exact --no-timings \
    --markdown "$OUT/compare.md"
