#!/usr/bin/env bash
# Device call: ring plans (correctness at world 2-4, busbw vs NCCL), gemm (fp16 fix),
# allgather_gemm (correctness + timing vs cuBLAS+NCCL and torch's fused op).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 120 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider \
  -k "collective_odd_count and ring" 2>&1 | tee "$OUT/pytest_ring.txt" | tail -3
timeout 100 python3 tools/gpu_gemm.py "$OUT" > "$OUT/gemm.txt" 2>&1; echo "gemm rc=$?"; grep -E "FAIL|target|shipped \|" "$OUT/gemm.txt" | head -8
timeout 230 python3 tools/bench_collectives.py "$OUT" --gpus 4 --ops allgather,reduce_scatter,all_reduce,broadcast \
  --sizes 1M,256M,1G --tune --only allgather_ring,reduce_scatter_ring,all_reduce_ring,broadcast_ring 2>&1 \
  | grep -E "^\| .*(ring|nccl)" | grep -v symm | tail -40
