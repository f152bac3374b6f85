#!/usr/bin/env bash
# Device call: allgather_gemm crash diagnosis (full child output), then the IPC backend checks.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
mkdir -p "$OUT/fused"
timeout 70 python3 tools/gpu_fused.py "$OUT/fused" --child check 2 > "$OUT/ag_gemm_check2.txt" 2>&1; echo "ag-gemm check rc=$?"
grep -vE "sys.excepthook|Original exception" "$OUT/ag_gemm_check2.txt" | tail -25
BUDGET=300 bash tools/gpu_ipc.sh 2>&1 | tail -30
