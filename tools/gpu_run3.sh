#!/usr/bin/env bash
# Device call: ring / pairwise variants (correctness, then busbw vs NCCL at large
# sizes), and a diagnosis of the copy-engine pull allgather.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 200 python3 tools/gpu_gemm.py "$OUT" > "$OUT/gemm.txt" 2>&1; echo "gemm rc=$?"; tail -25 "$OUT/gemm.txt"
timeout 150 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider \
  -k "collective_odd_count and (allgather_ring or broadcast_large)" 2>&1 | tee "$OUT/pytest_ring.txt" | tail -3
sed "s/^name: allgather_ce\$/name: agcepull/; s/  direction: push/  direction: pull/" specs/allgather_ce.yaml > /tmp/agcepull.yaml
timeout 60 python3 -m tsgen test /tmp/agcepull.yaml --gpus 2 --iters 3 > "$OUT/ce_pull.txt" 2>&1; echo "ce pull rc=$?"; head -c 3000 "$OUT/ce_pull.txt" | head -20
timeout 370 python3 tools/bench_collectives.py "$OUT" --gpus 4 --ops allgather,all_to_all,reduce_scatter,broadcast \
  --sizes 1M,256M,1G --tune --only ${ONLY:-allgather,allgather_ring,allgather_pull,all_to_all,reduce_scatter,reduce_scatter_large,broadcast,broadcast_large} 2>&1 | grep -vE "^\| (all|reduce|broad).*\| (nccl|symm)" | tail -60
