#!/usr/bin/env bash
# One device call (4 x H200) for allgather_gemm: correctness at world 2, 3, 4 (20 calls,
# poisoned outputs) and timing at world 4 against cuBLAS + NCCL and torch symm_mem's
# fused_all_gather_matmul; results under $OUT. Under 5 minutes (the script stops
# starting steps after ~280 s; each step has its own timeout).
# `--ops gemm_reduce_scatter` runs only gemm_reduce_scatter (world 2 and 4 checks, timing at
# world 4; under 4 minutes); both ops need FUSED_TIMEOUT=590. RS_ONLY="push interleaved,push add"
# (names of tools/gpu_fused.py RS_SPECS) checks and times only those.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout ${FUSED_TIMEOUT:-295} python3 tools/gpu_fused.py "$OUT" "$@"
