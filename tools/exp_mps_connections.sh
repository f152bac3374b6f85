#!/usr/bin/env bash
# Experiment (docs/lab/shared_gpu.md, 2026-11-26): do ipc ranks sharing one GPU under MPS fail when
# every rank process asks for CUDA_DEVICE_MAX_CONNECTIONS=32? The same `tsgen launch` runs with the
# variable set by the caller (tsgen keeps a caller's value) and without it (the driver default a rank
# of a process world now keeps), at 4 and 8 processes. Every run's output and the MPS server log
# go to $OUT. Prediction: with 32, 4 processes fail to start; without it, all pass.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
source "$(dirname "$0")/mps.sh"
export TSGEN_SHARE_GPUS=1
mps_start || { echo "MPS: the control daemon did not start"; exit 2; }
python3 -m tsgen build specs/allgather.yaml --compile >/dev/null
for n in 4 8; do
  for conn in 32 default; do
    log="$OUT/launch_n${n}_conn${conn}.txt"; start=$SECONDS
    if [ "$conn" = default ]; then unset CUDA_DEVICE_MAX_CONNECTIONS; else export CUDA_DEVICE_MAX_CONNECTIONS=$conn; fi
    timeout -k 5 120 python3 -m tsgen launch --nproc "$n" --grace 20 -- \
      python3 -m tsgen test specs/allgather.yaml --backend ipc --iters 10 >"$log" 2>&1
    rc=$?; unset CUDA_DEVICE_MAX_CONNECTIONS
    printf '%-3s %-8s rc=%-4s %4s s  %s\n' "$n" "$conn" "$rc" "$(( SECONDS - start ))" \
      "$(grep -m1 -oE 'cudaError[A-Za-z]*|PASS on [^(]*|FAIL on [^(]*' "$log" | head -n 1)" | tee -a "$OUT/table.txt"
  done
done
mps_stop "$OUT/mps_log"
cat "$OUT/table.txt"
