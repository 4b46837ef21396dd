#!/usr/bin/env bash
# In-process GPU self-check (no vLLM needed; scripts/gpu_check.sh checks the vLLM path). On one GPU:
#   1. tests/test_cuda.py: the engine, every method and the CLI on CUDA, against dense references on
#      the device and against the same runs on the CPU (skipped everywhere without CUDA);
#   2. `run` of NonShared, FullShared and KVCMAS on MMLU in $DTYPE (default bfloat16) with fidelity,
#      --limit $LIMIT (default 8): TTFT timed with synchronization, the device's peak memory per run;
#   3. benchmarks/delta_correction.py --device cuda --tokens 4096 in $DTYPE: the correction against
#      its GEMM floor and the dense prefill, the full-pool TTFT against FullShared's.
#   PY=python MODEL=meta-llama/Llama-3.1-8B-Instruct bash scripts/gpu_inprocess_check.sh
# MODEL defaults to the packaged SmolLM2-135M; OUT_DIR (default runs/gpu-inprocess) receives the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DTYPE=${DTYPE:-bfloat16}
OUT_DIR=${OUT_DIR:-runs/gpu-inprocess}
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py
for m in nonshared fullshared kvcmas; do
    "$PY" -m kvcmas_bench.cli run --method "$m" --workload mmlu ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --device cuda --dtype "$DTYPE" \
        --limit "${LIMIT:-8}" --max-new-tokens 32 --final-max-new-tokens 8 --fidelity -o "$OUT_DIR/run-$m"
done
"$PY" benchmarks/delta_correction.py ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --device cuda --dtype "$DTYPE" --tokens 4096 --repeats 5 \
    | tee "$OUT_DIR/delta_correction.txt"
echo "gpu_inprocess_check: PASSED (results in $OUT_DIR)"
