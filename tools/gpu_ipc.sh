#!/usr/bin/env bash
# Issue 5 on GPUs: one process per GPU (CUDA IPC backend). Needs 4 GPUs, CuPy and
# nvcc; torch is optional (with TSGEN_STORE=torch the ranks meet on its TCPStore; docs/design/runtime.md). Logs under
# $OUT/ipc; a PASS/FAIL table last (also $OUT/ipc_summary.txt). Every step has a
# timeout and the whole script stops starting steps after BUDGET s (default 285).
#   1. tsgen test --backend ipc at 2 and 4 ranks: primitives and collectives
#   2. a rank that dies mid-run: the others end with the kernel's timeout diagnostic
#   3. 100 create/use/destroy cycles of a World: device memory back where it was
#   4. allgather at 256 MiB: ipc time within 5 % of the single-process time
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
LOG=$OUT/ipc
source tools/steps.sh
TSGEN="python3 -m tsgen"
PRIMS="put_block signal_wait_eq_peer barrier_all simple_shift"
COLLS="allgather reduce_scatter all_to_all all_reduce_one_shot all_reduce_two_shot_pull"
export TSGEN_STORE=${TSGEN_STORE:-tsgen} TSGEN_STORE_TIMEOUT=${TSGEN_STORE_TIMEOUT:-60}

step "compile" 150 python3 tools/ipc_checks.py warm $PRIMS $COLLS

# 1. correctness under the ipc backend (tsgen's store; one run on torch's TCPStore)
for n in 2 4; do
  for s in $PRIMS $COLLS; do
    step "test ipc w$n $s" 60 $TSGEN launch --nproc $n -- $TSGEN test specs/$s.yaml --backend ipc --iters 20
  done
done
step "test ipc w4 allgather (torch store)" 60 \
  env TSGEN_STORE=torch $TSGEN launch --nproc 4 -- $TSGEN test specs/allgather.yaml --backend ipc --iters 20

# 2. rank 1 dies (SIGKILL) before call 2 of an allgather: every other rank waits for it, so
# each must print the kernel's timeout diagnostic and exit non-zero on its own (not stopped
# by the launcher), and tsgen launch must return rank 1's code (137)
step "dying rank: the others time out" 90 \
  python3 tools/ipc_checks.py dying-rank specs/allgather.yaml --nproc 4 --rank 1 --call 2

# 3. 100 create/use/destroy cycles, device memory before/after (2 MiB tolerance)
step "cycles single w4 x100" 120 python3 tools/ipc_checks.py cycles specs/allgather.yaml --backend single --gpus 4
step "cycles ipc w4 x100" 120 $TSGEN launch --nproc 4 -- python3 tools/ipc_checks.py cycles specs/allgather.yaml --backend ipc
grep -h "cycles in" "$LOG"/cycles_*.log

# 4. allgather at 256 MiB, 4 GPUs: single process vs one process per GPU, same run
step "bench single w4 allgather 256M" 120 \
  $TSGEN bench specs/allgather.yaml --gpus 4 --sizes 256M --no-baselines --json "$LOG/allgather_256M_single.json"
step "bench ipc w4 allgather 256M" 120 $TSGEN launch --nproc 4 -- \
  $TSGEN bench specs/allgather.yaml --backend ipc --sizes 256M --json "$LOG/allgather_256M_ipc.json"
step "allgather 256M ipc within 5% of single" 20 \
  python3 tools/ipc_checks.py compare "$LOG/allgather_256M_single.json" "$LOG/allgather_256M_ipc.json"
cat "$LOG/allgather_256M_ipc_within_5%_of_single.log" 2>/dev/null

summary "tsgen ipc backend on GPUs" ipc_summary.txt
