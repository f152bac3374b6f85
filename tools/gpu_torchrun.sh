#!/usr/bin/env bash
# Issue 31, item 2 on GPUs: one process per GPU started by torchrun, no tsgen launch. The ranks meet
# in torch.distributed's store (torchrun's agent store, or the process group's); NVSHMEM's unique
# id goes through the same store. Needs 2 GPUs, torch, CuPy, nvcc; nvshmem4py for the nvshmem steps
# (a FAIL with "needs nvshmem4py" where the image lacks it: tools/gpu_nvshmem.sh says how to carry it).
# Logs under $OUT/torchrun; the PASS/FAIL table last ($OUT/torchrun_summary.txt). Every step has a
# timeout; no step starts after BUDGET s (default 540). NVLink multicast stays off (device_env.sh).
#   1. torchrun -m tsgen test SPEC --backend ipc / nvshmem: tsgen's own test under torchrun (agent store)
#   2. tools/torchrun_world.py: a user script under torchrun, with an NCCL or gloo process group or
#      none: the store chosen, the spec against its reference, the group usable after, and a rank that
#      raises inside a World ending the others' waits within 5 s (CHECK lines)
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
LOG=$OUT/torchrun
BUDGET=${BUDGET:-540}
source tools/steps.sh
unset TSGEN_STORE TSGEN_STORE_SECRET  # auto: torch's store under torchrun
export TSGEN_STORE_TIMEOUT=${TSGEN_STORE_TIMEOUT:-60} TSGEN_STACKS_AFTER=${TSGEN_STACKS_AFTER:-60}
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"

step "environment" 60 python3 -c "
import torch, sys
n = torch.cuda.device_count()
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', n)
sys.exit(0 if n >= 2 else 1)" || { summary "tsgen under torchrun: needs 2 GPUs and torch" torchrun_summary.txt; exit 1; }
cat "$LOG/environment.log"
NVSHMEM=1
python3 -c "import nvshmem.core" > "$LOG/nvshmem_import.log" 2>&1 || { NVSHMEM=0; echo "nvshmem4py does not import:"; tail -2 "$LOG/nvshmem_import.log"; }
step "compile" 240 python3 tools/ipc_checks.py warm allgather all_to_all reduce_scatter allgather_nvshmem

# 1. tsgen's own test command under torchrun
for s in allgather all_to_all reduce_scatter; do
  step "torchrun tsgen test ipc w2 $s" 90 $RUN -m tsgen test specs/$s.yaml --backend ipc --iters 20
done
step "torchrun tsgen test nvshmem w2 allgather" 120 $RUN -m tsgen test specs/allgather.yaml --backend nvshmem --iters 20
step "torchrun tsgen test nvshmem w2 allgather_nvshmem" 120 \
  $RUN -m tsgen test specs/allgather_nvshmem.yaml --backend nvshmem --iters 20

# 2. a user script under torchrun, the World on the process group's store (or the agent's)
for g in nccl gloo none; do
  step "torchrun world ipc $g group" 120 $RUN tools/torchrun_world.py specs/allgather.yaml --backend ipc --group $g
done
step "torchrun world nvshmem nccl group" 150 \
  $RUN tools/torchrun_world.py specs/allgather_nvshmem.yaml --backend nvshmem --group nccl

grep -h "^CHECK " "$LOG"/*.log
[ $NVSHMEM = 1 ] || echo "(the nvshmem steps need nvshmem4py, which does not import here)"
summary "tsgen under torchrun (ipc, nvshmem) on 2 GPUs" torchrun_summary.txt
