# Sourced by device-run scripts whose ranks are processes sharing one GPU: an MPS control daemon
# for the run (without MPS such processes are time-sliced and never resident together).
#   mps_start          start it (pipe and log under /tmp/tsgen-mps); fails when it does not start
#   mps_stop LOG_COPY  stop it, copy the server's log (it names refused clients) to LOG_COPY
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/tsgen-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/tsgen-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control
  cp -r "$CUDA_MPS_LOG_DIRECTORY" "$1" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
