#!/usr/bin/env bash
# One device call (one GPU): the attention backward of this checkout against other commits', each in one run
# (tools/ab_tree.py, tools/gpu_attention_bwd.py --base-tree): for each tree given, every correctness check of both
# builds, then the bench rows ROWS (default: hd 128 MHA causal and not at S 8K / 16K, hd 64 causal and not at 8K)
# with ROUNDS (default 10) balanced rounds, x = the tree's time over this checkout's. Measured once (2026-11-28, one
# H200, the tool called directly): 4 rows x 8 rounds with every check took 113 s (the machine's start, ~35 s, comes
# on top); these defaults should take about 3 minutes a tree. Each tree gets an equal share of what is left of
# BUDGET (560 s), so that one slow tree does not starve the next; the tool writes its report only at its end, so a
# tree stopped at its share returns its log (in the archive), not its table. IMPLS (default base,shipped): the impls
# timed, e.g. base,shipped,base_r80,shipped_r80 (base_X: this checkout's shipped_X built by the tree).
#   here:    python tools/ab_tree.py make REV ...   (.ab/REV7, git-ignored; carry each, with .whl and .tsgen-commit)
#   device:  bash tools/gpu_bwd_ab.sh .ab/REV7 [.ab/REV7 ...]
# Each tree's report and JSON come back as $OUT/ab_REV7.{md,json}; the logs and build sources in $OUT/bwd_ab.tgz (a
# device call brings back only a few files); the step table in $OUT/bwd_ab.txt.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
WORK="$OUT/bwd_ab" LOG="$OUT/bwd_ab/logs" BUDGET=${BUDGET:-560}
mkdir -p "$WORK"
source "$(dirname "$0")/steps.sh"
[ $# -ge 1 ] || { echo "usage: bash tools/gpu_bwd_ab.sh .ab/REV7 [.ab/REV7 ...]" >&2; exit 2; }
ROWS=${ROWS:-hd128_full_kv32:8192,hd128_full_kv32:16384,hd128_causal_kv32:8192,hd128_causal_kv32:16384,hd64_causal_kv32:8192,hd64_full_kv32:8192}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$WORK/device.txt"
left=$#
for tree in "$@"; do
  rev=$(basename "$tree")
  share=$(((BUDGET - SECONDS) / left)); left=$((left - 1))
  step "against $rev" "$share" python3 tools/gpu_attention_bwd.py "$WORK/$rev" --base-tree "$tree" --impl "${IMPLS:-base,shipped}" \
    --rounds "${ROUNDS:-10}" --bench-shapes "$ROWS"
  cp "$WORK/$rev/attention_bwd.md" "$OUT/ab_$rev.md" 2>/dev/null
  cp "$WORK/$rev/attention_bwd.json" "$OUT/ab_$rev.json" 2>/dev/null
  grep -A14 "^## Speed" "$OUT/ab_$rev.md" 2>/dev/null
done
summary "attention backward A/B" bwd_ab.txt
rc=$?
tar czf "$OUT/bwd_ab.tgz" -C "$OUT" bwd_ab && rm -rf "$WORK"
exit $rc
