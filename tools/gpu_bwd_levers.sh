#!/usr/bin/env bash
# One device call (one GPU, about 6-8 minutes, a guess) for the attention backward's next levers
# (docs/design/attention.md, "FA4's sm_90 backward beside tsgen's"):
#   1. the 128-row step in FlashAttention-3's product order (params.dk_after_dq with step_rows 128, tool impl
#      wgmma_m128dkq): every correctness check of tools/gpu_attention_bwd.py on it and on the shipped kernels,
#      then the bench's hd 64 rows with x = wgmma_m128dkq's time over shipped's (predicted 0.94-0.98);
#   2. ncu's warp-stall samples per SASS instruction of one main-kernel launch at hd 128 causal 8K, tsgen's
#      (--ncu-source), and FA4's where tools/fa4_wheels.sh installed it on this warm machine first (three calls
#      carrying .whl-fa4/part1..3: its header), the summaries side by side.
# Everything it writes goes into $OUT/bwd_levers.tgz (a device call brings back only a few files), with the
# step table in $OUT/bwd_levers.txt and the two stall summaries beside it. Carry ".whl" and ".tsgen-commit".
#   bash tools/gpu_bwd_levers.sh            STEPS (a regular expression) runs some of the steps only
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
WORK="$OUT/bwd_levers" LOG="$OUT/bwd_levers/logs" BUDGET=${BUDGET:-560}
mkdir -p "$WORK"
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$WORK/device.txt"
fa4=""
if [ -f "${FA4_SITE:-/tmp/site-fa4}/.fa4-installed" ]; then
  eval "$(bash tools/fa4_wheels.sh env)"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-dsl-cache
  fa4=1
else
  echo "flash-attn-4 not installed on this machine (tools/fa4_wheels.sh: three calls first): tsgen's profile only"
fi
HD64=hd64_causal_kv32:4096,hd64_causal_kv32:8192,hd64_causal_kv32:16384,hd64_full_kv32:4096,hd64_full_kv32:8192,hd64_full_kv32:16384
step "tall dk_after_dq: checks and hd 64 bench" 330 python3 tools/gpu_attention_bwd.py "$WORK/tall_dkq" \
  --impl wgmma_m128dkq,shipped --bench-shapes "$HD64"
step "ncu source: tsgen hd128 causal 8K" 120 python3 tools/gpu_attention_bwd.py "$WORK/ncu" \
  --ncu hd128_causal_kv32:8192 --ncu-source
[ -n "$fa4" ] && step "ncu source: FA4 hd128 causal 8K" 150 python3 tools/gpu_attention_bwd.py "$WORK/ncu" \
  --ncu hd128_causal_kv32:8192 --ncu-source --ncu-baseline fa4
summary "attention backward levers" bwd_levers.txt
rc=$?
cp "$WORK"/ncu/src_*.txt "$OUT"/ 2>/dev/null
tar czf "$OUT/bwd_levers.tgz" --exclude="*.ncu-rep" -C "$OUT" bwd_levers && rm -rf "$WORK"  # the reports: tens of MB
exit $rc
