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


if __name__ == "__main__":  # pragma: no cover - used by tools/device_env.sh
    print("\n".join(f"export {k}={v}" for k, v in NO_MULTICAST.items()))
