#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests and the
# primitive benchmarks, leave logs and results under $OUT.
#   usage (on the device machine): bash tools/gpu_run.sh [pytest -k expr]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tsgen-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export TSGEN_CACHE_DIR=/tmp/tsgen-cache
{ nvidia-smi; nvidia-smi topo -m; python3 -c 'import cupy; print("cupy", cupy.__version__)'; } > "$OUT/env.txt" 2>&1
head -20 "$OUT/env.txt"
python3 -m tsgen build specs -o /tmp/gen --compile >> "$OUT/env.txt" 2>&1 || { tail -30 "$OUT/env.txt"; exit 1; }
K=${1:-}
export TSGEN_RESULTS_DIR="$OUT"
timeout 420 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider ${K:+-k "$K"} 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 240 python3 tools/bench_primitives.py "$OUT" --gpus 2 2>&1 | tail -40
fi
