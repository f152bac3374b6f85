#!/usr/bin/env bash
# The GPU gate: one device call (under 10 minutes) that a commit changing templates/, generated/ or
# tsgen/runtime/ must pass on a lent GPU before it counts as done (`tsgen results --check` warns
# when the newest gate result is older than the newest such commit).
#   one visible GPU:  the whole GPU suite with every rank sharing it (worlds 2, 3, 4, 8), and the
#                     vendoring example at W = 2, 3, 4 on it;
#   2 or more GPUs:   the suite one GPU per rank (worlds up to the GPU count), and the vendoring
#                     example at W = 2 .. the GPU count;
#   SPREAD=1, 2+ GPUs: the one-GPU gate (every world on one GPU) with the pytest workers spread over the
#                     GPUs, each worker seeing one of them (tests/conftest.py TSGEN_SPREAD_GPUS): the same
#                     tests in about 1 / GPUs of the time; recorded under the one-GPU kind;
#   PART=k/n:         part k of n of the suite (tests/conftest.py TSGEN_GATE_PART: by test id), for a gate
#                     longer than one call (the SPREAD gate on 2 GPUs); recorded as <date>-<commit>-partKofN,
#                     and the gate counts as passed once every part of one commit has (tsgen results --check);
#                     the vendoring example and the exhaustive CPU tests run in part 1.
# Then the `exhaustive` CPU tests (pytest -m exhaustive -n 8: what CI's default run deselects; their log is
# pytest_exhaustive.txt, their tally in gate.txt; a failure fails the gate). Then tools/summarize_shared.py writes results/tests/<kind>/<date>-<commit>.{json,md} under
# $OUT/results (failed test ids, skip reasons, every negative control's detection rate), and the
# logs go into $OUT/gate_logs-<kind>.tgz (a SPREAD gate and a W 2 gate in one call keep both).
#   bash tools/gpu_gate.sh [PYTEST_ARGS...]
# A session's two gates of one commit on 2 GPUs: SPREAD=1 bash tools/gpu_gate.sh, then EXHAUSTIVE=0 bash
# tools/gpu_gate.sh (the W 2 gate without a second run of the CPU tests).
# Workers: tools/gpu_lib.sh's gpu_workers (free GPU memory over WORKER_MIB, at most the cores less
# 2; JOBS overrides). PER_TEST (default 180) seconds before a test fails (pytest-timeout's signal method),
# not counting its time queued for the GPU's turn (tsgen/harness.py gpu_turn; every turn is logged in gpu_turn.jsonl).
set -uo pipefail
here=$(dirname "$0")
source "$here/device_env.sh"
source "$here/gpu_lib.sh"
run=$OUT/gate; mkdir -p "$run"
export TSGEN_RESULTS_DIR=$run
gpus=$(gpu_count)
kind=$(gpu_kind)
free=$(gpu_free_mib)
jobs=$(gpu_workers)
if [ "${SPREAD:-0}" = 1 ] && [ "$gpus" -gt 1 ]; then  # the one-GPU gate on each of the GPUs at once
  export TSGEN_SPREAD_GPUS=$(seq -s , 0 $((gpus - 1)))
  kind=$(CUDA_VISIBLE_DEVICES=0 gpu_kind)
  jobs=$(gpu_workers "$gpus")
  gpus=1  # every world on one GPU
fi
commit=${TSGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
part_args=() vendor=1
if [ -n "${PART:-}" ]; then
  export TSGEN_GATE_PART=$PART
  part_args=(--part "$PART")
  [ "${PART%%/*}" = 1 ] || vendor=0
fi
gpu_device_info "$run/device.txt"
echo "gate: $kind, $gpus GPU(s)${TSGEN_SPREAD_GPUS:+ per world, workers spread over GPUs $TSGEN_SPREAD_GPUS}, $jobs workers (free $free MiB), commit $commit" | tee -a "$run/gate.txt"
# per-process GPU memory once a second: the measured worker footprint for WORKER_MIB
( while sleep 1; do gpu_smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits; done ) \
  > "$run/apps_mem.txt" 2>/dev/null &
sampler=$!
start=$(date +%s)
if [ "$gpus" -eq 1 ]; then
  export TSGEN_SHARE_GPUS=1 log=pytest_shared.txt worlds="2 3 4"
  first="tests/test_cp_attention_gpu.py tests/test_moe_gpu.py tests/test_ulysses_gpu.py tests/test_gemm_gpu.py"
else
  unset TSGEN_SHARE_GPUS; export log=pytest_real.txt worlds=$(seq -s ' ' 2 "$gpus") first=""
fi
COLUMNS=240 python3 -m pytest -q -m gpu $first tests/ -n "$jobs" -p no:cacheprovider --timeout "${PER_TEST:-180}" \
  -o timeout_method=signal \
  -rfEs --durations=10 "$@" > "$run/$log" 2>&1
code=$?
kill "$sampler" 2>/dev/null
echo "suite wall time: $(( $(date +%s) - start )) s, exit $code" | tee -a "$run/device.txt"
peak=$(awk -F', *' '{ if ($2 > m) m = $2 } END { print m + 0 }' "$run/apps_mem.txt")
echo "largest test process on the GPU: $peak MiB" | tee -a "$run/gate.txt"
# the vendoring example (examples/vendor, no Python): W ranks on the visible GPUs
if [ "$vendor" = 0 ]; then
  :  # the vendoring example runs in part 1
elif [ -n "${TSGEN_SPREAD_GPUS:-}" ]; then  # the example's ranks on one GPU, as in the one-GPU gate
  CUDA_VISIBLE_DEVICES=0 gpu_vendor_example "$run/vendor.txt" $worlds || code=1
else
  gpu_vendor_example "$run/vendor.txt" $worlds || code=1
fi
# The `exhaustive` CPU tests (tests/conftest.py): the rest of the plan sweep (worlds 4-7) and of the variant
# build sweeps, which CI's default run deselects to stay in its time on 2 cores; no GPU, 8 workers, in part 1.
# EXHAUSTIVE=0 leaves them out (about 95 s of device time on an H200 host): for the second gate of one commit (the
# W 2 gate after the SPREAD one, whose run of them covers the commit), said in gate.txt.
if [ "${EXHAUSTIVE:-1}" = 0 ] && [ "$vendor" = 1 ]; then
  echo "exhaustive CPU tests: not run here (EXHAUSTIVE=0: another gate of commit $commit runs them)" \
    | tee -a "$run/gate.txt" "$run/device.txt"
elif [ "$vendor" = 1 ]; then
  xstart=$(date +%s)
  env -u TSGEN_SHARE_GPUS -u TSGEN_SPREAD_GPUS -u TSGEN_GATE_PART COLUMNS=240 \
    python3 -m pytest -q -n 8 -m exhaustive tests/ -p no:cacheprovider -rfE > "$run/pytest_exhaustive.txt" 2>&1 || code=1
  echo "exhaustive CPU tests: $(tail -n 1 "$run/pytest_exhaustive.txt") ($(( $(date +%s) - xstart )) s)" \
    | tee -a "$run/gate.txt" "$run/device.txt"
fi
# (--require-controls: a negative control that missed at any call fails the gate)
python3 "$here/summarize_shared.py" "$run" "$OUT/results" "$commit" \
  "${TSGEN_SPREAD_GPUS:+SPREAD=1 }${PART:+PART=$PART }${EXHAUSTIVE:+EXHAUSTIVE=$EXHAUSTIVE }bash tools/gpu_gate.sh $*" --kind "$kind" \
  --require-controls "${part_args[@]}" | tee -a "$run/gate.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || code=1
gpu_outcome "$run/$log" 25
find "$OUT/results" -type f \( -name "*.md" -o -name "*.json" \) -exec cp -t "$OUT" {} +
tar czf "$OUT/gate_logs-$kind.tgz" -C "$run" . && rm -rf "$run"  # what comes back: the logs in one file
exit "$code"
