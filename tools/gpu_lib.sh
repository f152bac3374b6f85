# Sourced by the GPU suite scripts (gpu_gate.sh, gpu_shared.sh, gpu_real.sh) after device_env.sh:
# what they share, in one place. Functions only; sourcing it runs nothing.
#   gpu_smi ARGS...        nvidia-smi on the visible GPUs (CUDA_VISIBLE_DEVICES, when set)
#   gpu_count              how many GPUs are visible
#   gpu_kind               nvidia-h200, nvidia-h100 (else the name in lower case), -xN for N > 1 GPUs
#   gpu_device_info FILE   the GPUs (a line each: name, driver, memory total and free), CuPy, torch and
#                          nvcc versions, then the date: on stdout and into FILE (tools/summarize_shared.py
#                          reads the lines before the date as the device)
#   gpu_workers            pytest-xdist workers: JOBS where set, else the least free GPU memory over
#                          WORKER_MIB (default 10240: on one H200, 17 workers ran contexts out of
#                          memory, 14 did not; with eager module loading every worker's context holds
#                          all its libraries' kernels), at least 1, and at most the cores less 2;
#                          gpu_workers N: N GPUs' worth of workers (each worker on one of N GPUs)
#   gpu_vendor_example LOG WORLD...   build examples/vendor (no Python, in a fresh private folder, removed
#                          after) and run allgather_demo at each world size, output appended to LOG;
#                          status 1 when the build or a run failed
#   gpu_outcome LOG [N]    the last N (default 25) failure and tally lines of a pytest log

gpu_smi() { nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i "$CUDA_VISIBLE_DEVICES"} "$@"; }

gpu_count() { gpu_smi --query-gpu=index --format=csv,noheader | wc -l; }

gpu_kind() {
  local name n kind
  name=$(gpu_smi --query-gpu=name --format=csv,noheader | head -n 1)
  n=$(gpu_count)
  case "$name" in
    *H200*) kind=nvidia-h200 ;;
    *H100*) kind=nvidia-h100 ;;
    *) kind=$(echo "$name" | tr -c 'a-zA-Z0-9\n' - | tr A-Z a-z) ;;
  esac
  [ "$n" -gt 1 ] && kind=$kind-x$n
  echo "$kind"
}

gpu_device_info() {
  { gpu_smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader
    python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
    nvcc --version | tail -n 2 | head -n 1
    date -u +%FT%TZ; } | tee "$1"
}

gpu_free_mib() { gpu_smi --query-gpu=memory.free --format=csv,noheader,nounits | sort -n | head -n 1; }

gpu_workers() {
  local free cores by_memory
  free=$(gpu_free_mib)
  cores=$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))
  by_memory=$(( ${free:-10240} / ${WORKER_MIB:-10240} * ${1:-1} ))
  [ "$by_memory" -ge 1 ] || by_memory=1
  echo "${JOBS:-$(( cores < by_memory ? cores : by_memory ))}"
}

gpu_vendor_example() {
  local log=$1 dir code=0 w
  shift
  # a private build folder of its own (not a fixed /tmp name another user could own or plant)
  dir=$(mktemp -d "${TMPDIR:-/tmp}/tsgen-vendor.XXXXXX") || { echo "vendoring example: no build folder" >> "$log"; return 1; }
  if cmake -S examples/vendor -B "$dir" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" >/dev/null \
     && cmake --build "$dir" >/dev/null; then
    for w in "$@"; do timeout 120 "$dir/allgather_demo" "$w" 1000003 20 >> "$log" 2>&1 || code=1; done
  else
    echo "vendoring example: build FAILED" >> "$log"; code=1
  fi
  rm -rf "$dir"
  return "$code"
}

gpu_outcome() { grep -E "^(FAILED|ERROR)|crashed|passed|failed" "$1" | tail -n "${2:-25}" | cut -c1-240; }
