#!/usr/bin/env bash
# One device call for the collectives: correctness on 2, 3, 4 GPUs, then the
# benchmark against NCCL / symm-mem. Logs and results under $OUT.
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
export TSGEN_CACHE_DIR=/tmp/tsgen-cache TSGEN_RESULTS_DIR="$OUT"
python3 -m tsgen build specs -o /tmp/gen --compile > "$OUT/env.txt" 2>&1 || { tail -30 "$OUT/env.txt"; exit 1; }
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "${TESTS_K:-collective}" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
fi
for g in ${BENCH_GPUS:-4}; do
  timeout ${BENCH_TIMEOUT:-420} python3 tools/bench_collectives.py "$OUT" --gpus $g ${BENCH_ARGS:-} 2>&1 | tail -70
done
