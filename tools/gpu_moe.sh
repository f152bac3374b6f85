#!/usr/bin/env bash
# One device call for the MoE op (specs/moe.yaml) on ONE GPU: every rank of worlds 2, 4 and 8
# shares it (TSGEN_SHARE_GPUS=1). Steps: compile; dispatch + combine at each world (every routing
# case, per-rank token counts 0 / 1 / odd / random, poisoned buffers, plain and weighted, 20
# back-to-back pairs); receive overflow reported; the negative control (counts wait removed,
# rank skew) must fail; the low-latency mode likewise (specs/moe_ll.yaml); `tsgen test` of both
# specs through the runtime's path; fp8 dispatch (specs/moe_fp8.yaml) with its error measured;
# `tsgen bench` of the three specs at world 4 (shared: tsgen alone, the PyTorch baseline needs
# one GPU per rank). Logs and result rows under $OUT;
# the PASS/FAIL table prints last. Under 4 minutes (BUDGET, default 230 s).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TSGEN_SHARE_GPUS=1
LOG="$OUT/moe" BUDGET=${BUDGET:-230}
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
T="python3 -m pytest -q -p no:cacheprovider -rs tests/test_moe_gpu.py"
step "compile moe, moe_ll, moe_fp8" 120 python3 -m tsgen build specs/moe.yaml specs/moe_ll.yaml specs/moe_fp8.yaml --compile
step "dispatch+combine world 2"   45 $T -k "dispatch_combine and 2-"
step "dispatch+combine world 4"   45 $T -k "dispatch_combine and 4-"
step "dispatch+combine world 8"   60 $T -k "dispatch_combine and 8-"
step "receive overflow reported"  30 $T -k receive_overflow
step "negative control must fail" 30 $T -k "negative_control and not low_latency"
step "fp8 dispatch world 2, 4, 8"  75 $T -k "fp8"
step "low-latency world 2, 4, 8"  75 $T -k "low_latency and not overflow and not negative"
step "low-latency slot overflow"  30 $T -k "low_latency and overflow"
step "low-latency neg. control"   30 $T -k "low_latency and negative_control"
for w in 2 4 8; do
  step "tsgen test moe world $w"    25 python3 -m tsgen test specs/moe.yaml --gpus $w --share-gpus
  step "tsgen test moe_ll world $w" 25 python3 -m tsgen test specs/moe_ll.yaml --gpus $w --share-gpus
  step "tsgen test moe_fp8 world $w" 25 python3 -m tsgen test specs/moe_fp8.yaml --gpus $w --share-gpus
done
for spec in moe moe_fp8 moe_ll; do  # bench entries (shared: tsgen alone, timings not comparable)
  step "bench $spec world 4"        40 python3 -m tsgen bench specs/$spec.yaml --gpus 4 --share-gpus --sizes 1,127 \
    --iters 10 --reps 3 --json "$OUT/bench_$spec.json"
done
summary "moe on one GPU, shared worlds" moe_summary.txt
