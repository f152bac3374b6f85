#!/usr/bin/env bash
# One device call for the attention backward (one GPU, < 5 min): build the variants, check dQ, dK, dV
# against a float32 reference (S 1000 with tails, 4096, q_len != kv_len, 20 back-to-back calls,
# poisoned outputs and workspace; causal and not, GQA, hd 64 and 128, fp16, bhsd; two chained after
# tsgen's forward), a bench against torch autograd of SDPA's backward (flash, cuDNN) and cudnn-frontend
# (8 rounds in a balanced order, an untimed call before each sample), then the shipped specs through
# the harness (tests/test_gpu.py's one-GPU sweep). Results under $OUT.
# Arguments go to the script: --impl mma_sync,wgmma checks and benches both main kernels (give it
# ATTENTION_BWD_TIMEOUT=600: twice the children).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# FlashAttention-4's backward beside SDPA's (column fa4) where tools/fa4_wheels.sh installed it first
if [ -f "${FA4_SITE:-/tmp/site-fa4}/.fa4-installed" ]; then
  eval "$(bash tools/fa4_wheels.sh env)"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-dsl-cache  # as gpu_attention_baselines.sh
fi
rc=0
timeout ${ATTENTION_BWD_TIMEOUT:-420} python3 tools/gpu_attention_bwd.py "$OUT" "$@" || rc=1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "attention_through_the_harness and attention_backward" \
  2>&1 | tail -15 || rc=1
exit $rc
