#!/usr/bin/env bash
# One device call on ONE GPU for the Ulysses all-to-alls (ulysses_pre_a2a, ulysses_post_a2a), ranks
# sharing the GPU (TSGEN_SHARE_GPUS=1), under 4 minutes (BUDGET, default 230 s):
#   1. GPU tests: tests/test_ulysses_gpu.py (variants checked by a consumer on each rank's stream at
#      world sizes 2, 3, 4, 8; the negative control without the arrival wait, which must fail; the
#      timeout probe) and the shipped specs through `tsgen test` (tests/test_gpu.py -k ulysses: odd
#      lengths, 20 back-to-back calls, poisoned outputs, world sizes 2, 3, 4, 8)
#   2. `tsgen bench` of each spec with 4 ranks sharing the GPU (labelled not comparable; no baseline
#      on a shared GPU: the runner says so): every bench code path and the timed-output check.
# Logs under $OUT/logs, bench JSON under $OUT, a short table last.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TSGEN_SHARE_GPUS=1
LOG=$OUT/logs BUDGET=${BUDGET:-230}
source "$(dirname "$0")/steps.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
  nvcc --version | tail -n 2 | head -n 1; date -u +%FT%TZ; } | tee "$OUT/device.txt"
TSGEN="python3 -m tsgen"

step "build + compile the ulysses specs" 60 $TSGEN build specs/ulysses_pre_a2a.yaml specs/ulysses_pre_a2a_gqa.yaml \
  specs/ulysses_post_a2a.yaml -o /tmp/ulysses-gen --compile
step "GPU tests (shared GPU)" 150 python3 -m pytest -q -m gpu tests/test_ulysses_gpu.py tests/test_gpu.py -k "ulysses" \
  -n "${JOBS:-6}" -p no:cacheprovider -rs --durations=8
for s in ulysses_pre_a2a ulysses_post_a2a ulysses_pre_a2a_gqa; do
  step "bench $s (4 ranks, shared)" 40 $TSGEN bench specs/$s.yaml --gpus 4 --share-gpus --sizes 4K,16K \
    --iters 10 --reps 3 --json "$OUT/bench_$s.json"
done
python3 - "$OUT" <<'PY' | tee "$OUT/ulysses_table.txt"
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("bench_*.json")):
    d = json.loads(f.read_text())
    print(f"== {f.stem}: {len(d['rows'])} rows, {len(d['errors'])} errors; {'; '.join(d.get('notes', []))[:120]}")
    for r in d["rows"]:
        print(f"{r['impl'][:30]:30s} S={r['size']:>6} {r['time_us']:9.1f} us  busbw {r.get('busbw_GBps') or 0:6.1f} GB/s "
              f"read {r.get('read_B', 0) / 2**20:7.1f} MiB written {r.get('written_B', 0) / 2**20:7.1f} MiB "
              f"vs min {r.get('moved_vs_min', 0):.2f}  {r.get('check', '')[:30]}  wrong {r.get('wrong', '-')}")
    for e in d["errors"][:4]:
        print("ERROR", e[:200])
PY
summary "gpu_ulysses" ulysses_summary.txt
