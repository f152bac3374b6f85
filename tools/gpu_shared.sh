#!/usr/bin/env bash
# The whole GPU test suite on ONE GPU: every rank of every world (2, 3, 4, 8) shares it
# (TSGEN_SHARE_GPUS=1), the spec variants that fit are derived per test, test processes
# compile in parallel and take turns on the GPU. Logs and result rows under $OUT.
#   bash tools/gpu_shared.sh [PYTEST_ARGS...]     e.g. -k negative_control
# JOBS (default: the cores less 2, at most one per 8 GiB of GPU memory: with eager module loading
# every worker's context holds all its libraries' kernels, and 15 workers on an 80 GB H100 ran one
# out of memory): pytest-xdist workers; PER_TEST (default 180): seconds before a test fails;
# MPS=1: the ipc backend's tests too, under an MPS daemon (see below); FIRST: test files collected
# (and so handed to the workers) before the rest of tests/; SUITE=0: not the suite itself (with
# MPS=1: the ipc tests alone).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TSGEN_SHARE_GPUS=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
  nvcc --version | tail -n 2 | head -n 1; date -u +%FT%TZ; } \
  | tee "$OUT/device.txt"
start=$(date +%s)
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
cores=$(( $(nproc) > 4 ? $(nproc) - 2 : 2 )); by_memory=$(( ${mib:-16384} / 8192 > 1 ? ${mib:-16384} / 8192 : 1 ))
code=0
if [ "${SUITE:-1}" != 0 ]; then
  python3 -m pytest -q -m gpu ${FIRST:-} tests/ -n "${JOBS:-$(( cores < by_memory ? cores : by_memory ))}" -p no:cacheprovider --timeout "${PER_TEST:-180}" \
    --durations=10 -rfEs "$@" 2>&1 | tee "$OUT/pytest_shared.txt"
  code=${PIPESTATUS[0]}
  echo "suite wall time: $(( $(date +%s) - start )) s, exit $code" | tee -a "$OUT/device.txt"
fi
# MPS=1: then the ipc backend's tests (one process per rank, every process on this GPU), under an
# MPS control daemon started here and stopped after them (without MPS those processes are
# time-sliced and never resident together: the suite above skips them).
if [ -n "${MPS:-}" ]; then
  source "$(dirname "$0")/mps.sh"
  if mps_start; then
    timeout -k 5 "${MPS_LIMIT:-240}" python3 -m pytest -q -m gpu tests/test_gpu_ipc.py -p no:cacheprovider \
      --timeout "${PER_TEST:-180}" -rfEs 2>&1 | tee "$OUT/pytest_ipc_mps.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || code=1
    mps_stop "$OUT/mps_log"
  else
    echo "MPS: the control daemon did not start" | tee "$OUT/pytest_ipc_mps.txt"; code=1
  fi
fi
# The vendoring example (examples/vendor, no Python): W ranks on this machine's GPUs.
if [ -z "${SKIP_VENDOR:-}" ]; then
  cmake -S examples/vendor -B /tmp/vendor -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" >/dev/null \
    && cmake --build /tmp/vendor >/dev/null || code=1
  for w in 2 3 4; do /tmp/vendor/allgather_demo "$w" 1000003 20 >>"$OUT/vendor.txt" 2>&1 || code=1; done
  cat "$OUT/vendor.txt"
fi
exit "$code"
