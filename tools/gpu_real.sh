#!/usr/bin/env bash
# The GPU test suite on this machine's GPUs, one GPU per rank (TSGEN_SHARE_GPUS unset: worlds
# larger than the GPU count skip, with the reason): every family at the world sizes the machine
# has, the ipc and nvshmem backends with one process per GPU. Test processes compile in parallel
# and take turns on the GPUs (TSGEN_GPU_LOCK: two processes' contexts time-sliced on one GPU slow
# each other's spinning kernels past their wait timeouts). Verbose, so that a test whose worker
# died is named. Logs under $OUT.   bash tools/gpu_real.sh [PYTEST_ARGS...]
# JOBS (default: tools/gpu_lib.sh's gpu_workers, from the free GPU memory, as the gate sizes them)
# workers, PER_TEST (default 150) seconds per test. The gate (tools/gpu_gate.sh) runs the same
# suite on 2 or more GPUs, without the lock and -v, and summarizes it.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/gpu_lib.sh"
unset TSGEN_SHARE_GPUS
export TSGEN_GPU_LOCK=/tmp/tsgen-gpu-real.lock
gpu_device_info "$OUT/device.txt"
start=$(date +%s)
python3 -m pytest -m gpu tests/ -v -n "$(gpu_workers)" -p no:cacheprovider --timeout "${PER_TEST:-150}" -rfEs \
  --durations=10 "$@" > "$OUT/pytest_real.txt" 2>&1
code=$?
echo "suite wall time: $(( $(date +%s) - start )) s, exit $code" | tee -a "$OUT/device.txt"
gpu_outcome "$OUT/pytest_real.txt" 30
exit "$code"
