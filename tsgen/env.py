"""The one place that says which environment everything tsgen starts runs under.

NVLink multicast (NVLS, multimem) is never used: on shared machines a program that uses it
can take the host's GPUs out of service. NCCL, NVSHMEM and PyTorch's symmetric memory each
have a switch; `force_no_multicast` sets all three (overwriting whatever the caller had).
It is called, not run at import: by the CLI before any command, by `World` before it loads
CUDA libraries, by `tsgen launch` for every rank's environment, by the benchmark's baseline
workers and by the test suite. `python -m tsgen.env` prints the shell exports (the device
scripts source them).
"""

from __future__ import annotations

import os
from typing import MutableMapping

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def force_no_multicast(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set the no-multicast variables in `env` (default: this process's os.environ); returns it."""
    env = os.environ if env is None else env
    env.update(NO_MULTICAST)
    return env


# For processes whose ranks share a GPU, set before the first CUDA call (cuInit reads them):
# - CUDA_DEVICE_MAX_CONNECTIONS: 32 hardware queues, the most the driver takes. Streams beyond
#   the queues are folded onto them, and one rank's spinning kernel at the head of a queue would
#   hold up another rank's work behind it, which it may be waiting for.
# - CUDA_MODULE_LOADING=EAGER: every kernel of a module is loaded when the module is, before any
#   rank launches. Lazily loaded, a kernel is loaded at its first launch, and loading may wait for
#   the kernels already running on the device; a host launcher loading its second kernel while its
#   first spins for a peer whose launch is stuck behind that load never returns (measured on one
#   H100: cp_attention at W 4 and 8 and moe at W 4 each had a rank wait 3-10 s on a peer's first
#   signal, while W 2 passed; the CUDA programming guide's lazy-loading section names the risk).
SHARED_GPU = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "CUDA_MODULE_LOADING": "EAGER"}


def shared_gpu_env(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set SHARED_GPU in `env` (default: os.environ) where the caller has not set them; returns it."""
    env = os.environ if env is None else env
    for key, value in SHARED_GPU.items():
        env.setdefault(key, value)
    return env


if __name__ == "__main__":  # pragma: no cover - used by tools/device_env.sh
    print("\n".join(f"export {k}={v}" for k, v in NO_MULTICAST.items()))
