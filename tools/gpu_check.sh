#!/usr/bin/env bash
# One device call (4 x H200) of named steps, in the order given; logs under $OUT/logs, results
# under $OUT, a PASS/FAIL table last (tools/steps.sh; BUDGET seconds in all, default 540).
#   bash tools/gpu_check.sh STEP...
#   rs           gemm_reduce_scatter: checks at world 2 and 4 + timing at world 4 against cuBLAS+NCCL and
#                torch's fused op (tools/gpu_fused.py; RS_ONLY="push interleaved,push add" picks specs)
#   ag           allgather_gemm: checks at world 2, 3, 4 + timing at world 4 (same baselines)
#   rs-test      `tsgen test` (elementwise, NumPy reference) of RS_TEST specs at each of their world sizes
#   ar-small     small all_reduce variants against NCCL and symm-mem (AR_ONLY: variant labels of
#                tools/bench_collectives.py; AR_SIZES, default 1K,64K,256K,1M)
#   large        256 MiB and 1 GiB: allgather, reduce_scatter, all_to_all, all_reduce against NCCL (LARGE_ONLY labels)
#   collectives  every collective test of tests/test_gpu.py (all specs at world 2, 3, 4, dtypes, controls;
#                PYTEST_K narrows the -k expression)
#   sass         SASS_GREP (an ERE) in the cuobjdump -sass of the SASS_SPEC build
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
LOG=$OUT/logs BUDGET=${BUDGET:-540}
source "$(dirname "$0")/steps.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1

for s in "$@"; do
  case $s in
    rs) step "gemm_reduce_scatter" 300 env FUSED_TIMEOUT=295 bash tools/gpu_fused.sh --ops gemm_reduce_scatter
        grep -E "PASS|FAIL|us \(rel|torch|cuBLAS" "$LOG/gemm_reduce_scatter.log" | tail -24 ;;
    ag) step "allgather_gemm" 330 env FUSED_TIMEOUT=325 bash tools/gpu_fused.sh --ops allgather_gemm
        grep -E "PASS|FAIL|us \(rel|torch|cuBLAS" "$LOG/allgather_gemm.log" | tail -24 ;;
    rs-test)
      for spec in ${RS_TEST:-specs/gemm_reduce_scatter_push_add.yaml}; do
        for w in $(python3 -c "import yaml,sys; print(*yaml.safe_load(open(sys.argv[1]))['world_sizes'])" "$spec"); do
          step "test $(basename "$spec" .yaml) w$w" 120 python3 -m tsgen test "$spec" --gpus "$w"
          tail -1 "$LOG/test_$(basename "$spec" .yaml)_w$w.log"
        done
      done ;;
    ar-small) step "all_reduce small" 300 python3 tools/bench_collectives.py "$OUT/ar_small" --gpus 4 --ops all_reduce \
                --sizes "${AR_SIZES:-1K,64K,256K,1M}" --tune --only "${AR_ONLY:-all_reduce_one_shot,all_reduce_two_shot_pull}"
              grep -E "^\| all_reduce" "$OUT/ar_small/collectives_bench_w4.md" ;;
    large) step "collectives large" 400 python3 tools/bench_collectives.py "$OUT/large" --gpus 4 \
             --ops allgather,reduce_scatter,all_to_all,all_reduce --sizes 256M,1G \
             --only "${LARGE_ONLY:-allgather,allgather_ring,reduce_scatter,reduce_scatter_ring,all_to_all,all_reduce_ring}"
           grep -E "^\| " "$OUT/large/collectives_bench_w4.md" | cut -c1-150 ;;
    collectives) step "pytest collectives" 480 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "${PYTEST_K:-collective}"
                 tail -3 "$LOG/pytest_collectives.log" ;;
    sass) step "sass $(basename "${SASS_SPEC:-}" .yaml)" 120 bash -c \
            "python3 -m tsgen build '$SASS_SPEC' -o \$OUT/gen --compile >/dev/null && cuobjdump -sass \$TSGEN_CACHE_DIR/\$(basename '$SASS_SPEC' .yaml)-*.so | grep -cE '$SASS_GREP'"
          cat "$LOG/sass_$(basename "${SASS_SPEC:-}" .yaml).log" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
summary "gpu_check $*" gpu_check_summary.txt
