#!/usr/bin/env bash
# One device call for the collectives: correctness on 2, 3, 4 GPUs, then the
# benchmark against NCCL / symm-mem. Logs and results under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
python3 -m tsgen build specs -o /tmp/gen --compile > "$OUT/env.txt" 2>&1 || { tail -30 "$OUT/env.txt"; exit 1; }
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "${TESTS_K:-collective}" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
fi
for g in ${BENCH_GPUS:-4}; do
  timeout ${BENCH_TIMEOUT:-420} python3 -m tsgen bench --suite collectives-w$g --results "$OUT/results" ${BENCH_ARGS:-} 2>&1 | tail -70
done
