#!/usr/bin/env bash
# One device call for the copy-engine collectives: correctness at world 2, 3, 4
# (odd counts, 20 calls), then busbw against NCCL in the same run.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
python3 -m tsgen build specs/*_ce.yaml -o /tmp/gen --compile > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -x \
  -k "${TESTS_K:-collective_odd_count and _ce}" 2>&1 | tee "$OUT/pytest_ce.txt" | tail -8
timeout ${BENCH_TIMEOUT:-330} python3 -m tsgen bench --suite ce-w4 --results "$OUT/results" 2>&1 | tail -40
