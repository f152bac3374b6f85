#!/usr/bin/env bash
# Issue 5 on GPUs: the NVSHMEM backend (one process per GPU, each an NVSHMEM PE) and the
# nvshmem device transport. Needs 4 GPUs, CuPy, nvcc, nvidia-nvshmem-cu13 and nvshmem4py
# (carried as a wheel in .whl/; cuda-core / cuda-pathfinder from .whl/fallback/ only if the
# image's are too old). Logs under $OUT/nvshmem; a PASS/FAIL table last. PART picks what runs
# (each part fits one device call):
#   tests (default)  compile; tsgen test --backend nvshmem at 2 and 4 ranks: primitives,
#                    collectives and the nvshmem-transport allgather / all_to_all; a rank that
#                    dies mid-run
#   all              tests, then perf
#   cycles           only the 100 cycles
#   perf             100 create/use/destroy cycles (device memory before/after); busbw of the
#                    nvshmem-transport allgather / all_to_all next to their p2p variants, all
#                    under the nvshmem backend, and the p2p variants under ipc
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
LOG=$OUT/nvshmem
BUDGET=${BUDGET:-540}
source tools/steps.sh
PART=${PART:-tests}
TSGEN="python3 -m tsgen"
# TEST_SPECS / WORLDS narrow the tests part (default: all specs below, at 4 and 2 ranks)
PRIMS="put_block signal_wait_eq_peer barrier_all simple_shift"
COLLS="allgather reduce_scatter all_to_all all_reduce_one_shot all_reduce_two_shot_pull"
NVSH="allgather_nvshmem all_to_all_nvshmem put_warp_nvshmem get_block_nvshmem simple_shift_nvshmem barrier_all_nvshmem"
TEST_SPECS=${TEST_SPECS:-"$NVSH $COLLS $PRIMS"}
WORLDS=${WORLDS:-"4 2"}
export TSGEN_STORE=${TSGEN_STORE:-tsgen} TSGEN_STORE_TIMEOUT=${TSGEN_STORE_TIMEOUT:-60}
# One host: NVSHMEM's bootstrap over loopback, no network transport (a multi-node run sets
# these to its NIC and transport instead: docs/running.md "Multi-node with NVSHMEM").
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
# a rank still running after 40 s prints every thread's Python stack (steps time out at 50-60 s)
export TSGEN_STACKS_AFTER=${TSGEN_STACKS_AFTER:-40} NVSHMEM_DEBUG=${NVSHMEM_DEBUG:-WARN}

if ! python3 -c "import nvshmem.core" > "$LOG/import.log" 2>&1; then
  echo "nvshmem4py does not import with the image's cuda-core; adding .whl/fallback:"; tail -3 "$LOG/import.log"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/fallback/*.whl || exit 2
fi
python3 - <<'PY' 2>&1 | tee "$LOG/versions.txt"
import importlib.metadata as md
for p in ("nvshmem4py-cu13", "nvidia-nvshmem-cu13", "cuda-core", "cuda-bindings", "cupy-cuda13x"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
import nvshmem.core  # noqa: F401
PY

if [ "$PART" = tests ] || [ "$PART" = all ]; then
  step "compile" 240 python3 tools/ipc_checks.py warm $TEST_SPECS
  step "smoke nvshmem w2 allgather" 90 $TSGEN launch --nproc 2 -- $TSGEN test specs/allgather.yaml --backend nvshmem --iters 3
  for n in $WORLDS; do
    for s in $TEST_SPECS; do
      step "test nvshmem w$n $s" 50 $TSGEN launch --nproc $n -- $TSGEN test specs/$s.yaml --backend nvshmem --iters 20
    done
  done
  step "dying rank (nvshmem): the others time out" 90 \
    python3 tools/ipc_checks.py dying-rank specs/allgather.yaml --nproc 4 --rank 1 --call 2 --backend nvshmem
  if [ "$PART" = tests ]; then summary "tsgen nvshmem backend on GPUs: tests" nvshmem_tests_summary.txt; exit $?; fi
fi

# perf
[ "$PART" = cycles ] && step "compile" 120 python3 tools/ipc_checks.py warm allgather
step "cycles nvshmem w4 x100" 150 \
  $TSGEN launch --nproc 4 -- python3 tools/ipc_checks.py cycles specs/allgather.yaml --backend nvshmem
grep -h "cycles in" "$LOG"/cycles_*.log
if [ "$PART" = cycles ]; then summary "tsgen nvshmem backend on GPUs: cycles" nvshmem_cycles_summary.txt; exit $?; fi
SIZES=${SIZES:-16M,256M,1G}
for s in allgather_nvshmem allgather all_to_all_nvshmem all_to_all; do
  step "bench nvshmem w4 $s" 120 $TSGEN launch --nproc 4 -- \
    $TSGEN bench specs/$s.yaml --backend nvshmem --sizes $SIZES --json "$LOG/bench_${s}_nvshmem.json"
done
if [ -n "${WITH_IPC:-}" ]; then
  for s in allgather all_to_all; do
    step "bench ipc w4 $s" 90 $TSGEN launch --nproc 4 -- \
      $TSGEN bench specs/$s.yaml --backend ipc --sizes $SIZES --json "$LOG/bench_${s}_ipc.json"
  done
fi
python3 tools/ipc_checks.py busbw "$LOG"/bench_*.json | tee "$OUT/nvshmem_busbw.md"
summary "tsgen nvshmem backend on GPUs: $PART" nvshmem_${PART}_summary.txt
