#!/usr/bin/env bash
# The GPU checks of KV handoff (issue 16), for a machine with CUDA (and vllm installed):
# transports cuda_ipc / nccl (two GPUs) / tcp moving a 7B-shaped paged cache at 1k/4k/16k
# tokens, and two vLLM engines handing a moved request off on the GPU. Figures go to
# $OUT/kv_transfer.jsonl (default bench/results/gpu/), the pytest log beside them.
#
#     scripts/gpu_kv_checks.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT"
export OUT
PY="${PY:-.venv/bin/python}"
PYTHONPATH="$PWD" timeout "${GYRE_GPU_TIMEOUT_S:-540}" "$PY" -m pytest -q -p no:cacheprovider \
  tests/gpu/test_kv_transfer.py -rs "$@" 2>&1 | tee "$OUT/kv_transfer.log"
echo "figures: $OUT/kv_transfer.jsonl"
