#!/usr/bin/env bash
# One device call for the gemm op: correctness (M tails, tiny M, 20 back-to-back
# calls, spec variants) and tsgen against cuBLAS at 8192^3; results under $OUT.
# About a minute; the script stops starting children after 170 s.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout ${GEMM_TIMEOUT:-240} python3 tools/gpu_gemm.py "$OUT" "$@"
