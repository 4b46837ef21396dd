#!/usr/bin/env bash
# One-command self-check of the vLLM path on a GPU machine (NOT run yet: no GPU was available while
# it was written). Needs a CUDA build of vLLM in the environment of $PY (default .venv-vllm/bin/python;
# `pip install vllm` next to this project's torch). Runs, in under ~8 minutes on one GPU:
#   1. the exactness checks against a real `vllm serve` with KVCMASConnector (tiny random Llama, float32
#      and again bfloat16 against bfloat16 references:
#      NonShared = plain vLLM, FullShared on identical prefixes = NonShared, KVCMAS V=1 = NonShared,
#      rejected gate = NonShared, no prefix-cache hit on injected K/V, state freed per trajectory),
#      and the in-process vLLM checks;
#   2. one short sweep on the given model (default: the packaged SmolLM2-135M) in bfloat16.
#   PY=/path/to/python MODEL=meta-llama/Llama-3.1-8B-Instruct bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv-vllm/bin/python}
"$PY" -c "import torch, vllm, sys; assert torch.cuda.is_available(), 'no CUDA device'; print('vLLM', vllm.__version__, torch.cuda.get_device_name(0))"
# server and in-process tests in separate sessions: each starts vLLM at 0.9 GPU memory utilization
"$PY" -m pytest -q -rs tests/test_vllm_server.py tests/test_vllm_api.py
"$PY" -m pytest -q -rs tests/test_vllm_backend.py
# exactness in bfloat16 against bfloat16 dense references (tolerance: BF16_TOL in the test file)
KVCMAS_VLLM_DTYPE=bfloat16 "$PY" -m pytest -q -rs tests/test_vllm_server.py -k "plain_vllm or identical_prefixes or full_rank_anchor or rejected_gate or recomputing_every_token or prefix_cache"
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
"$PY" -m kvcmas_bench.cli serve-sweep --engine vllm ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --device cuda --dtype bfloat16 \
    --method nonshared,fullshared,kvcmas,kvcomm,graphflow --qps 0,4 --shared-tokens 1024 --trajectories 4 \
    --calib-trajectories 2 --output-tokens 16 --engine-arg stop_at_first_token=true -o runs/gpu-check
echo "gpu_check: PASSED (results in runs/gpu-check)"
