#!/usr/bin/env bash
# Final device call: cannon / summa (correctness on 4 GPUs, TFLOP/s vs cuBLAS on the whole
# matrix), then small-message all_reduce variants against NCCL and symm-mem.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
FUSED_TIMEOUT=120 bash tools/gpu_fused.sh --ops cannon summa 2>&1 | grep -vE "sys.excepthook|Original exception|^\s*$" | tail -25
timeout 150 python3 tools/bench_collectives.py "$OUT" --gpus 4 --ops all_reduce --sizes 64K,256K,1M --tune \
  --only all_reduce_one_shot,all_reduce_two_shot_pull 2>&1 | grep -E "^\| all_reduce" | tail -30
