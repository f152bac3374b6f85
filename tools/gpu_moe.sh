#!/usr/bin/env bash
# One device call for the MoE op on ONE GPU: every rank of worlds 2, 4 and 8 shares it
# (TSGEN_SHARE_GPUS=1). Steps, most important first, each time-limited (a failure does not stop
# the next): compile the three specs; normal mode bf16 (tests/test_moe_gpu.py: every routing case,
# per-rank token counts 0 / 1 / odd / random, poisoned buffers, plain and weighted combine, 20
# back-to-back dispatch + combine pairs, receive overflow reported, the negative control with its
# counts wait removed that must fail); fp8 dispatch (bytes and scales exact, the error against bf16
# measured); low-latency mode (likewise, slot overflow, its negative control); negative controls
# for dispatch's data wait and both combines' waits (back-to-back pairs); a pair captured into a
# CUDA graph per rank and replayed; `tsgen test` of each
# spec through the runtime's path at world 4; `tsgen bench` at world 4 (shared: tsgen alone, the
# PyTorch baseline needs a GPU per rank). Logs and result rows (moe.jsonl) under $OUT; the fp8
# error and the PASS/FAIL table print last. Under 4 minutes (BUDGET, default 230 s).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TSGEN_SHARE_GPUS=1
LOG="$OUT/moe" BUDGET=${BUDGET:-230}
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
T="python3 -m pytest -q -n 3 -p no:cacheprovider -rs tests/test_moe_gpu.py"  # xdist: a trapped context ends only its worker
step "compile moe, moe_fp8, moe_ll"       90 python3 -m tsgen build specs/moe.yaml specs/moe_fp8.yaml specs/moe_ll.yaml --compile
step "normal bf16, worlds 2 4 8 + control" 100 $T -k "dispatch_combine or receive_overflow or counts_wait"
step "fp8 dispatch, worlds 2 4 8"         60 $T -k fp8
step "low-latency, worlds 2 4 8 + control" 80 $T -k low_latency
step "negative controls, other waits"     60 $T -k other_waits
step "CUDA graph replays, 3 specs"        45 $T -k graph_replays
for spec in moe moe_fp8 moe_ll; do
  step "tsgen test $spec world 4"         25 python3 -m tsgen test specs/$spec.yaml --gpus 4 --share-gpus
done
for spec in moe moe_ll; do
  step "bench $spec world 4"              30 python3 -m tsgen bench specs/$spec.yaml --gpus 4 --share-gpus --sizes 1,127 \
    --iters 10 --reps 3 --json "$OUT/bench_$spec.json"
done
python3 - "$OUT/moe.jsonl" <<'PY' || true
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    rows = []
for r in rows:
    for line in r.get("lines", []):
        if line.startswith("fp8:"):
            print(f"world {r['world']}: {line}")
    if r.get("problems"):
        print(f"{r['test']} world {r.get('world')}: {r['problems'][:2]}")
PY
summary "moe on one GPU, shared worlds" moe_summary.txt
