#!/usr/bin/env bash
# Device call: broadcast_large correctness, the SM+DMA hybrid experiment, and the
# small-size / tuning bench for allgather, all_reduce, broadcast (world 4).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 120 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -x \
  -k "collective_odd_count and broadcast_large" 2>&1 | tee "$OUT/pytest_bcast.txt" | tail -3
timeout 150 python3 tools/exp_hybrid.py "$OUT" --bytes 1G 2>&1 | tee "$OUT/exp_hybrid.txt" | tail -8
timeout 400 python3 tools/bench_collectives.py "$OUT" --gpus 4 --ops allgather,all_reduce,broadcast \
  --sizes 64K,256K,1M,256M,1G --tune 2>&1 | tail -75
