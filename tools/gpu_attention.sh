#!/usr/bin/env bash
# One device call for the attention op: correctness (lengths, tails, offsets, zig-zag, GQA,
# layouts, fp16, KV waits, 20 back-to-back calls, the runtime path, a timeout probe) and tsgen
# against torch SDPA (flash, cuDNN); results under $OUT. The script keeps to --deadline (220 s).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout ${ATTENTION_TIMEOUT:-235} python3 tools/gpu_attention.py "$OUT" "$@"
