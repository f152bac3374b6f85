#!/usr/bin/env bash
# One device call on a machine with 2 or more GPUs: the whole GPU test suite twice, at the same time
# (tools/gpu_shared.sh, each with its own workers, GPU lock, pytest temp folder and $OUT folder):
#   $OUT/one: every rank of every world on GPU 0 (CUDA_VISIBLE_DEVICES=0): the one-GPU proof
#   $OUT/all: over all the GPUs (TSGEN_SHARE_GPUS=1): worlds up to the GPU count on real links,
#             one GPU per rank (the ipc and nvshmem backends too); larger worlds with ranks sharing
# The vendoring example runs in the one-GPU half. JOBS_ONE / JOBS_ALL (default 10 each) workers;
# LIMIT (default 540) seconds for both. Each half summarizes with tools/summarize_shared.py.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m; nvidia-smi nvlink --status | head -n 8; } > "$OUT/topology.txt" 2>&1
head -n 12 "$OUT/topology.txt"
root=$OUT
( export OUT=$root/one CUDA_VISIBLE_DEVICES=0 TSGEN_GPU_LOCK=/tmp/tsgen-gpu-one.lock JOBS=${JOBS_ONE:-10}
  mkdir -p "$OUT"; timeout -k 10 "${LIMIT:-540}" bash tools/gpu_shared.sh --basetemp=/tmp/pt-one > "$OUT/run.log" 2>&1
  echo "exit $?" >> "$OUT/run.log" ) &
( export OUT=$root/all TSGEN_GPU_LOCK=/tmp/tsgen-gpu-all.lock JOBS=${JOBS_ALL:-10} SKIP_VENDOR=1
  mkdir -p "$OUT"; timeout -k 10 "${LIMIT:-540}" bash tools/gpu_shared.sh --basetemp=/tmp/pt-all > "$OUT/run.log" 2>&1
  echo "exit $?" >> "$OUT/run.log" ) &
wait
for half in one all; do
  echo "== $half: $(tail -n 1 "$root/$half/run.log")"
  grep -E "^(FAILED|ERROR)|passed|failed" "$root/$half/pytest_shared.txt" 2>/dev/null | tail -n 25 | cut -c1-220
done
tail -n 4 "$root/one/vendor.txt" 2>/dev/null
