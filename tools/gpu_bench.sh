#!/usr/bin/env bash
# One device call on ONE GPU (an H100 or H200): the bench wing's GPU evidence, under 8 minutes.
#   1. `tsgen bench --suite gemm`: gemm_bf16 at M = 4096, 8192, 16384 (N = K = 8192) against cuBLAS in
#      the same run, the timed outputs checked on sampled rows (no poison left, rel err <= 1e-2)
#   2. the guard's negative controls on the GPU, which must FAIL as timings (exit 0 = caught):
#      gemm with no launch after the warm-up, and with its events on other streams; a collective
#      (allgather, 4 ranks sharing the GPU, CUDA graphs) with its events on other streams
#   3. `tsgen bench --suite shared-smoke`: a fused op (allgather_gemm, 2 ranks) and collectives
#      (4 ranks) with ranks sharing the GPU: every code path, labelled not comparable
# Results in the index layout under $OUT/results (copy them into results/, then `tsgen results`),
# logs under $OUT/logs, a short table last. TSGEN_COMMIT=<commit> names the results where the
# copy of the tree has no .git. BUDGET (default 460) seconds in all.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TSGEN_COMMIT=${TSGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LOG=$OUT/logs BUDGET=${BUDGET:-460}
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
  nvcc --version | tail -n 2 | head -n 1; date -u +%FT%TZ; echo "commit $TSGEN_COMMIT"; } | tee "$OUT/device.txt"
TSGEN="python3 -m tsgen"

step "gemm vs cuBLAS (suite gemm)" 240 $TSGEN bench --suite gemm --results "$OUT/results" --json "$OUT/gemm.json"
step "control gemm skip-launch" 90 $TSGEN bench specs/gemm_bf16.yaml --sizes 8192 --negative-control skip-launch
step "control gemm other-stream" 90 $TSGEN bench specs/gemm_bf16.yaml --sizes 8192 --negative-control other-stream
step "control allgather shared other-stream" 90 $TSGEN bench specs/allgather.yaml --gpus 4 --share-gpus \
  --sizes 1M --negative-control other-stream
step "shared-GPU benches (suite shared-smoke)" 200 $TSGEN bench --suite shared-smoke --results "$OUT/results" \
  --json "$OUT/shared_smoke.json"

for f in "$LOG"/control_*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -E "^ERROR|caught|got through" "$f" | cut -c1-220 | head -6; }; done
python3 - "$OUT" <<'EOF' | tee "$OUT/gemm_table.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("gemm.json", "shared_smoke.json"):
    f = out / name
    if not f.exists():
        print(f"{name}: missing (the step failed: see logs)")
        continue
    d = json.loads(f.read_text())
    print(f"== {name}: {d['meta'].get('device', {}).get('name')}, commit {d['meta'].get('commit')}, "
          f"{len(d['rows'])} rows, {len(d['errors'])} errors")
    for r in d["rows"]:
        ratio = " ".join(f"vs {k[:12]} {v:.3f}" for k, v in (r.get("ratios") or {}).items())
        perf = f"{r['TFLOPs']:7.1f} TFLOP/s" if r.get("TFLOPs") else f"{r.get('busbw_GBps') or 0:7.1f} GB/s"
        print(f"{(r.get('label') or r['impl'])[:34]:34s} {r['size']:>9} {r['time_us']:10.1f} us +-{r['spread_pct']:4.1f}% "
              f"{perf} {ratio} {r.get('check', '')[:22]} {r.get('rel_err') or ''} {r.get('note', '')[:26]}")
    for e in d["errors"][:5]:
        print("ERROR", e[:200])
EOF
# The device tool brings back folders a few levels deep only: the results index travels as one archive
# (tar xzf results.tgz -C results/ here, then `tsgen results`).
[ -d "$OUT/results" ] && tar czf "$OUT/results.tgz" -C "$OUT/results" . && rm -rf "$OUT/results"
summary "gpu_bench (commit $TSGEN_COMMIT)" gpu_bench_summary.txt
