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


# The per-job secret `tsgen launch` gives every rank it starts (a new one per launch): tsgen's
# rendezvous store serves only clients that prove they know it (tsgen/runtime/store_server.py).
STORE_SECRET = "TSGEN_STORE_SECRET"


def env_seconds(name: str, default: str | None, error: type[Exception], env=None,
                zero_ok: bool = False) -> float | None:
    """The seconds in environment variable `name` (`default` when unset; None for a None default):
    a finite number > 0 (>= 0 with `zero_ok`), else `error` with a message naming the variable
    and its value (`float` alone takes 'inf', 'nan' and '1e999')."""
    import math

    text = (os.environ if env is None else env).get(name) or default  # set but empty: unset
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    problem = seconds_problem(value, zero_ok)
    if problem:
        raise error(f"{name}={text!r}: {problem}")
    return value


def seconds_problem(value: float, zero_ok: bool) -> str | None:
    """What is wrong with `value` as a number of seconds (finite, > 0, or >= 0 where `zero_ok`);
    None when nothing is. The one rule for variables (env_seconds) and options (tsgen launch)."""
    import math

    if math.isfinite(value) and (value >= 0 if zero_ok else value > 0):
        return None
    return f"give the seconds as a finite number {'>= 0' if zero_ok else '> 0'}"


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
# The variables of SHARED_GPU that tsgen set itself (not the caller), comma-separated: child
# processes inherit them, and a child that is one rank of a multi-process world takes back the
# ones that do not suit it.
SET_BY_TSGEN = "TSGEN_SHARED_GPU_SET"


def shared_gpu_env(env: MutableMapping[str, str] | None = None,
                   rank_per_process: bool = False) -> MutableMapping[str, str]:
    """Set SHARED_GPU in `env` (default: os.environ) where the caller has not set them; returns it.

    `rank_per_process`: this process is one rank of a world of processes sharing GPUs under MPS
    (the ipc backend). It drives one rank, so it needs no extra hardware queues, and under MPS
    every client's queues come out of one pool per GPU that each client holds exclusively
    (NVIDIA's MPS guide on CUDA_DEVICE_MAX_CONNECTIONS: raising it "may reduce the number of
    available clients"). Such a process leaves the variable at the driver's default, and drops
    it where a tsgen parent set it (SET_BY_TSGEN); a value the caller set stays."""
    env = os.environ if env is None else env
    ours = set(filter(None, env.get(SET_BY_TSGEN, "").split(",")))
    wanted = dict(SHARED_GPU)
    if rank_per_process:
        key = "CUDA_DEVICE_MAX_CONNECTIONS"
        del wanted[key]
        if key in ours:
            env.pop(key, None)
            ours.discard(key)
    for key, value in wanted.items():
        if key not in env:
            env[key] = value
            ours.add(key)
    if ours:
        env[SET_BY_TSGEN] = ",".join(sorted(ours))
    else:
        env.pop(SET_BY_TSGEN, None)
    return env


if __name__ == "__main__":  # pragma: no cover - used by tools/device_env.sh
    print("\n".join(f"export {k}={v}" for k, v in NO_MULTICAST.items()))
