#!/usr/bin/env bash
# One device call (several GPUs) of named steps, in the order given; logs under $OUT/logs, results
# under $OUT, a PASS/FAIL table last (tools/steps.sh; BUDGET seconds in all, default 540).
#   bash tools/gpu_check.sh STEP...
#   rs           `tsgen bench --suite gemm-rs-w4`: gemm_reduce_scatter specs against cuBLAS+NCCL and torch's fused op
#   ag           `tsgen bench --suite allgather-gemm-w4` (same baselines)
#   rs-test      `tsgen test` (elementwise, NumPy reference) of RS_TEST specs at each of their world sizes
#   ar-small     `tsgen bench --suite small-allreduce-w4`: small all_reduce variants against NCCL and symm-mem
#   large        `tsgen bench --suite large-w4`: 256 MiB and 1 GiB against NCCL
#   SUITE=NAME[@SECONDS]  any suite of suites/ (results of every suite step under $OUT/results, the index
#                layout), time-limited to SECONDS (default 480)
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
    rs|ag|ar-small|large|SUITE=*)
      case $s in rs) suite=gemm-rs-w4 ;; ag) suite=allgather-gemm-w4 ;; ar-small) suite=small-allreduce-w4 ;;
                 large) suite=large-w4 ;; *) suite=${s#SUITE=} ;; esac
      limit=480; case $suite in *@*) limit=${suite#*@}; suite=${suite%@*} ;; esac
      step "suite $suite" "$limit" python3 -m tsgen bench --suite "$suite" --results "$OUT/results"
      tail -40 "$LOG/suite_$suite.log" | grep -E "^(==|tsgen |ERROR|note)" | cut -c1-160 ;;
    rs-test)
      for spec in ${RS_TEST:-specs/gemm_reduce_scatter_push_add.yaml}; do
        for w in $(python3 -c "import yaml,sys; print(*yaml.safe_load(open(sys.argv[1]))['world_sizes'])" "$spec"); do
          step "test $(basename "$spec" .yaml) w$w" 120 python3 -m tsgen test "$spec" --gpus "$w"
          tail -1 "$LOG/test_$(basename "$spec" .yaml)_w$w.log"
        done
      done ;;
    collectives) step "pytest collectives" 480 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "${PYTEST_K:-collective}"
                 tail -3 "$LOG/pytest_collectives.log" ;;
    sass) step "sass $(basename "${SASS_SPEC:-}" .yaml)" 120 bash -c \
            "python3 -m tsgen build '$SASS_SPEC' -o \$OUT/gen --compile >/dev/null && cuobjdump -sass \$TSGEN_CACHE_DIR/\$(basename '$SASS_SPEC' .yaml)-*.so | grep -cE '$SASS_GREP'"
          cat "$LOG/sass_$(basename "${SASS_SPEC:-}" .yaml).log" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
[ -d "$OUT/results" ] && tar czf "$OUT/results.tgz" -C "$OUT/results" .  # the device tool returns shallow paths only
summary "gpu_check $*" gpu_check_summary.txt
