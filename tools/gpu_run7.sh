#!/usr/bin/env bash
# Device call: host launchers now run one thread per rank: copy-engine collectives again,
# then allgather_gemm (checks at world 2-4, timing vs cuBLAS+NCCL and torch fused).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 90 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "collective_odd_count and _ce" 2>&1 | tail -2
FUSED_TIMEOUT=420 bash tools/gpu_fused.sh --ops allgather_gemm gemm_reduce_scatter 2>&1 | grep -vE "sys.excepthook|Original exception|^\s*$" | tail -30
