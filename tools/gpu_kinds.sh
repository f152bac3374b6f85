#!/usr/bin/env bash
# One device call on ONE GPU for the selection of ops by their families' attributes (category,
# gpu_sweep, variant_worlds, transport, is_multimem; tsgen/ops/base.py, tsgen/shipped.py), ranks
# sharing the GPU (TSGEN_SHARE_GPUS=1), under 4 minutes (BUDGET, default 230 s):
#   1. the GPU test ids (pytest --collect-only -m gpu): 515 expected, the same as before the change
#   2. the harness's copy-engine refusal, now decided by family.transport(spec): `tsgen test
#      specs/allgather_ce.yaml` with 2 ranks sharing the GPU must fail with the copy-engine message
#   3. a sample of each sweep of tests/test_gpu.py in shared mode: the "specs" sweep (put_block
#      at 2 and 8, moe, ulysses, allgather_gemm), the collective sweep (allgather, all_to_all_v,
#      and the _ce specs, which must skip with the copy-engine reason), the one-GPU sweep
#      (attention_hd64_causal), the multimem and NVSHMEM refusals
# Logs under $OUT/logs, a short table last.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
LOG=$OUT/logs BUDGET=${BUDGET:-230} TSGEN_SHARE_GPUS=1
export TSGEN_SHARE_GPUS
source "$(dirname "$0")/steps.sh"
step "device" 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ"
cp "$LOG/device.log" "$OUT/device.txt" 2>/dev/null; cat "$OUT/device.txt" 2>/dev/null

step "GPU test ids (515 expected)" 60 bash -c \
  "python3 -m pytest --collect-only -q -m gpu tests/ -p no:cacheprovider | sort > '$OUT/gpu_ids.txt'; grep -q '^515/' '$OUT/gpu_ids.txt'"
step "copy-engine spec refused on a shared GPU" 60 bash -c \
  "! python3 -m tsgen test specs/allgather_ce.yaml --gpus 2 --share-gpus > '$LOG/ce_refusal.txt' 2>&1 && grep -q 'copy-engine transport does not run on a shared GPU' '$LOG/ce_refusal.txt'"
step "test_gpu.py sweeps, a sample (shared GPU)" 150 python3 -m pytest -q -m gpu tests/test_gpu.py -n "${JOBS:-4}" \
  -p no:cacheprovider -rs --durations=8 -k "put_block-2 or put_block-8 or moe-2 or ulysses_pre_a2a-3 or allgather_gemm-2 \
or collective-allgather-3 or collective-allgather-8 or all_to_all_v-3 or _ce- or attention_hd64_causal \
or test_multimem_is_refused or test_nvshmem_transport_is_refused"
grep -E "passed|failed" "$LOG"/test_gpu.py_sweeps*.log 2>/dev/null | tail -n 2
grep -c "copy-engine transport: refused" "$LOG"/test_gpu.py_sweeps*.log 2>/dev/null | sed 's/^/copy-engine skips: /'
summary "gpu_kinds" kinds_summary.txt
