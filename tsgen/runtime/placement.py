"""Where ranks run: one GPU per rank, or several ranks sharing a GPU.

A world whose ranks share GPUs (`World(size, share_gpus=True)`, `tsgen test
--share-gpus`, `TSGEN_SHARE_GPUS=1`) places rank r on visible GPU r % G, so a
machine with one GPU can run (and test) a kernel built for any world size.
Every rank keeps its own heap (its own allocation) and its own non-blocking
stream, so the kernels see exactly what they see on separate GPUs; what they
compete for is the SMs: blocks that wait on other blocks or ranks hang unless
every co-located rank's grid is resident at once. This module holds the pure
arithmetic of that (no GPU needed): the placement, the residency check and the
grid that fits. docs: docs/testing.md "Testing on one GPU".
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Mapping

from ..errors import RuntimeSetupError

SHARE_ENV = "TSGEN_SHARE_GPUS"
# The environment of processes whose ranks share a GPU (hardware queues, eager module loading):
# tsgen/env.py, SHARED_GPU.


def share_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """TSGEN_SHARE_GPUS=1 turns shared-GPU worlds on for scripts and the test suite."""
    value = env.get(SHARE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise RuntimeSetupError(f"{SHARE_ENV}={value!r}: set it to 1 (share GPUs between ranks) or 0")
    return value == "1"


def place_ranks(size: int, visible: int, share: bool, shown: str = "") -> list[int]:
    """The GPU of every rank: rank r on GPU r without sharing (too few GPUs is an error that
    names --share-gpus), rank r on GPU r % visible with it. `shown`: how the GPUs were
    selected, for the message (e.g. the CUDA_VISIBLE_DEVICES value). Pure."""
    if size < 1:
        raise RuntimeSetupError(f"world size {size}: need at least one rank")
    if visible < 1:
        raise RuntimeSetupError("no CUDA device is visible")
    if share:
        return [r % visible for r in range(size)]
    if size > visible:
        raise RuntimeSetupError(
            f"world size {size} needs {size} GPUs, but this machine shows {visible}{shown}. To test on fewer "
            f"GPUs, let ranks share them: --share-gpus (or TSGEN_SHARE_GPUS=1); timings of a shared GPU "
            "measure nothing about the op"
        )
    return list(range(size))


def ranks_per_gpu(devices: Mapping[int, int] | list[int]) -> int:
    """The most ranks any one GPU hosts (1 when each rank has its own). Pure."""
    gpus = list(devices.values()) if isinstance(devices, Mapping) else list(devices)
    return max(Counter(gpus).values(), default=1)


def residency_problem(kernel: str, blocks: int, colocated: int, sms: int, per_sm: int) -> str | None:
    """Why `colocated` ranks' grids of `blocks` blocks cannot all be resident on one GPU of
    `sms` SMs holding `per_sm` of these blocks each, or None. Pure."""
    fit = sms * per_sm
    if blocks * colocated <= fit:
        return None
    if colocated == 1:
        return (f"{kernel}: grid of {blocks} blocks cannot all be resident ({sms} SMs x {per_sm} blocks per SM); "
                f"its blocks wait on each other, so it would hang. Lower launch.blocks to <= {fit}")
    return (f"{kernel}: {colocated} ranks share this GPU, and their grids of {blocks} blocks "
            f"({colocated * blocks} in all) cannot all be resident ({sms} SMs x {per_sm} blocks per SM = {fit}); "
            f"blocks that wait on other ranks would hang. At most {fit // colocated} blocks per rank fit: "
            "`tsgen test --share-gpus` derives such a variant of the spec, or lower launch.blocks")


def fit_blocks(blocks: int, colocated: int, sms: int, multiple: int = 1, floor: int = 1, reserve: int = 0) -> int:
    """The largest grid <= `blocks` of which `colocated` copies fit on `sms` SMs at one block per
    SM (the bound that holds whatever the kernel's occupancy), each rank also leaving `reserve`
    SMs to kernels that must run beside it; rounded down to `multiple` (a cluster size), and at
    least `floor`. Raises when even that does not fit. Pure."""
    room = sms // colocated - reserve
    fitted = min(blocks, room) // multiple * multiple
    need = max(floor, multiple)
    if fitted < need:
        raise RuntimeSetupError(
            f"{colocated} ranks on one GPU of {sms} SMs leave {sms // colocated} SMs per rank"
            f"{f' ({reserve} of them reserved)' if reserve else ''}; this kernel needs at least {need} blocks "
            "per rank: use fewer ranks per GPU"
        )
    return fitted


def mps_active(env: Mapping[str, str] = os.environ, exists=os.path.exists) -> bool:
    """Whether an MPS control daemon is reachable: its pipe directory (CUDA_MPS_PIPE_DIRECTORY,
    default /tmp/nvidia-mps) holds the `control` pipe. Processes that share a GPU without MPS
    are time-sliced, so their kernels are never resident together. Pure given `exists`."""
    pipe_dir = env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return bool(exists(os.path.join(pipe_dir, "control")))
