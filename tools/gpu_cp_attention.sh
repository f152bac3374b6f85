#!/usr/bin/env bash
# One device call for cp_attention on ONE GPU (ranks share it: TSGEN_SHARE_GPUS=1, the SM push
# variant): the GPU tests (worlds 2, 4, 8; contiguous / zig-zag, causal / not, GQA, odd lengths,
# 20 calls, poisoned outputs, rank skew, the negative control that must fail), the cost of the
# per-chunk waits with every signal raised against the plain kernel, and the bench entry in shared
# mode (rows labelled not comparable, no baselines). Logs and result rows under $OUT; a table last.
# About 4 minutes; each step time-limited, a failed step does not stop the others.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/cp_logs" BUDGET=${BUDGET:-235}
source "$(dirname "$0")/steps.sh"
export TSGEN_SHARE_GPUS=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
step "compile cp_attention specs" 60 python3 -m tsgen build specs/cp_attention.yaml \
  specs/cp_attention_zigzag_causal.yaml specs/cp_attention_zigzag_causal_sm.yaml --compile
step "shared-GPU tests (worlds 2 4 8)" 150 python3 -m pytest -q -m gpu tests/test_cp_attention_gpu.py -n 4 \
  -p no:cacheprovider -rs --durations=8
step "wait cost (signals pre-raised)" 50 python3 tools/gpu_cp_attention.py "$OUT" --seqs 8192,16384
step "bench entry (shared: not comparable)" 40 python3 -m tsgen bench specs/cp_attention_zigzag_causal_sm.yaml \
  --gpus 2 --share-gpus --sizes 4096 --json "$OUT/cp_bench_shared.json"
tail -n 12 "$LOG/wait_cost_(signals_pre-raised).log" 2>/dev/null
grep -E "passed|failed" "$LOG/shared-GPU_tests_(worlds_2_4_8).log" 2>/dev/null | tail -n 3
summary "cp_attention on one GPU" cp_summary.txt
