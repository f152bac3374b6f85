#!/usr/bin/env bash
# One device call for the attention backward (one GPU, < 5 min): build the variants, check dQ, dK, dV
# against a float32 reference (S 1000 with tails, 4096, q_len != kv_len, 20 back-to-back calls,
# poisoned outputs and workspace; causal and not, GQA, hd 64 and 128, fp16, bhsd; two chained after
# tsgen's forward), a short bench against torch autograd of SDPA's backward (flash, cuDNN), then the
# shipped specs through the harness (tests/test_gpu.py's one-GPU sweep). Results under $OUT.
# Arguments go to the script: --impl mma_sync,wgmma checks and benches both main kernels (give it
# ATTENTION_BWD_TIMEOUT=480: twice the children).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# FlashAttention-4's backward beside SDPA's (column fa4) where tools/fa4_wheels.sh installed it first
if [ -f "${FA4_SITE:-/tmp/site-fa4}/.fa4-installed" ]; then
  eval "$(bash tools/fa4_wheels.sh env)"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-dsl-cache  # as gpu_attention_baselines.sh
fi
rc=0
timeout ${ATTENTION_BWD_TIMEOUT:-210} python3 tools/gpu_attention_bwd.py "$OUT" "$@" || rc=1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "attention_through_the_harness and attention_backward" \
  2>&1 | tail -15 || rc=1
exit $rc
