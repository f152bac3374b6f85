#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests and the primitives-w2
# benchmark suite, leave logs and results under $OUT.
#   usage (on the device machine): bash tools/gpu_run.sh [pytest -k expr]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi; nvidia-smi topo -m; python3 -c 'import cupy; print("cupy", cupy.__version__)'; } > "$OUT/env.txt" 2>&1
head -20 "$OUT/env.txt"
python3 -m tsgen build specs -o /tmp/gen --compile >> "$OUT/env.txt" 2>&1 || { tail -30 "$OUT/env.txt"; exit 1; }
K=${1:-}
export TSGEN_RESULTS_DIR="$OUT"
timeout 420 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider ${K:+-k "$K"} 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 240 python3 -m tsgen bench --suite primitives-w2 --results "$OUT/results" 2>&1 | tail -40
fi
