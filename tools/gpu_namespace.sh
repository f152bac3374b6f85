#!/usr/bin/env bash
# One device call on ONE GPU (H100 or H200), under 4 minutes: the kernels after the hand-written
# helpers moved into namespace tsgen (issue 13 item 5). One spec per op template through
# `tsgen test` (ranks share the GPU: TSGEN_SHARE_GPUS=1), a negative control, the wait-timeout
# probe (its trap is now tsgen::timeout_trap), and the vendoring example (extern "C" names).
# Logs under $OUT/logs, a PASS/FAIL table last. BUDGET (default 225) seconds in all.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TSGEN_SHARE_GPUS=1
LOG=$OUT/logs BUDGET=${BUDGET:-225}
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2 | head -n 1; date -u +%FT%TZ; } | tee "$OUT/device.txt"
TSGEN="python3 -m tsgen"
# name:ranks (0: one GPU, no sharing); the copy-engine and multimem templates are left out (refused
# on a shared GPU / never run here), cp_attention runs its SM variant
SPECS="simple_shift:3 allgather:4 reduce_scatter:3 all_to_all_v:2 barrier_all:3 barrier_blocks:2
  signal_wait_eq_local:2 remote_ld_acquire_sys_u64:2 get_block:2 gemm_bf16:0 gemm_reduce_scatter:2
  allgather_gemm:2 cannon:4 attention_hd128:0 ulysses_post_a2a:2 cp_attention_zigzag_causal_sm:2 moe:2"

step "compile the specs" 90 $TSGEN build $(for s in $SPECS; do echo "specs/${s%%:*}.yaml"; done) --compile
for s in $SPECS; do
  name=${s%%:*} ranks=${s##*:}
  if [ "$ranks" = 0 ]; then
    step "test $name (1 GPU)" 40 $TSGEN test "specs/$name.yaml" --gpus 1
  else
    step "test $name $ranks ranks" 40 $TSGEN test "specs/$name.yaml" --gpus "$ranks" --share-gpus
  fi
done
step "negative controls fail (simple_shift, barrier_blocks)" 60 python3 -m pytest -q -m gpu tests/test_gpu.py \
  -p no:cacheprovider -k "test_negative_control_fails and (simple_shift or barrier_blocks)"
step "probe timeout (tsgen::timeout_trap prints)" 40 $TSGEN test specs/allgather.yaml --gpus 2 --share-gpus --probe-timeout
step "vendoring example (extern \"C\" names)" 60 bash -c 'cmake -S examples/vendor -B /tmp/vendor \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" >/dev/null && cmake --build /tmp/vendor >/dev/null \
  && /tmp/vendor/allgather_demo 2 1000003 5'
summary "namespace tsgen on one GPU" namespace_table.txt
