#!/usr/bin/env bash
# The whole GPU test suite on ONE GPU: every rank of every world (2, 3, 4, 8) shares it
# (TSGEN_SHARE_GPUS=1), the spec variants that fit are derived per test, test processes
# compile in parallel and take turns on the GPU. Logs and result rows under $OUT.
#   bash tools/gpu_shared.sh [PYTEST_ARGS...]     e.g. -k negative_control
# JOBS (default: tools/gpu_lib.sh's gpu_workers, from the free GPU memory, as the gate sizes them):
# pytest-xdist workers; PER_TEST (default 180): seconds before a test fails;
# MPS=1: the ipc backend's tests too, under an MPS daemon (see below); FIRST: test files collected
# (and so handed to the workers) before the rest of tests/; SUITE=0: not the suite itself (with
# MPS=1: the ipc tests alone).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/gpu_lib.sh"
export TSGEN_SHARE_GPUS=1
gpu_device_info "$OUT/device.txt"
start=$(date +%s)
code=0
if [ "${SUITE:-1}" != 0 ]; then
  python3 -m pytest -q -m gpu ${FIRST:-} tests/ -n "$(gpu_workers)" -p no:cacheprovider --timeout "${PER_TEST:-180}" \
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
  gpu_vendor_example "$OUT/vendor.txt" 2 3 4 || code=1
  cat "$OUT/vendor.txt"
fi
exit "$code"
