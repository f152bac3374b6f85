"""Do the GPUs in use form a full NVLink mesh?

tsgen's p2p kernels store into every peer directly, so they assume every pair
of GPUs is connected the same way. NVML (`pip install nvidia-ml-py`, part of
the cuda12 / cuda13 extras) says which pairs have NVLink. A *partial* mesh --
some pairs on NVLink, some not -- is refused, naming the pair (set
TSGEN_ALLOW_PARTIAL_MESH=1 to run over the slower path anyway). A machine
with no NVLink at all (PCIe P2P) and one without NVML fall back to
cudaDeviceCanAccessPeer, which the backends check anyway.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

from ..errors import RuntimeSetupError


def mesh_problem(labels: Sequence[str], nvlink: Sequence[Sequence[bool]]) -> str | None:
    """None when every pair of GPUs has NVLink both ways, or no pair has; otherwise a
    message naming the first pair without it. `nvlink[i][j]`: GPU i reaches GPU j
    over NVLink. Pure."""
    n = len(labels)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    linked = [(i, j) for i, j in pairs if nvlink[i][j] and nvlink[j][i]]
    if not linked or len(linked) == len(pairs):
        return None
    i, j = next(p for p in pairs if p not in linked)
    a, b = linked[0]
    return (f"{labels[i]} and {labels[j]} have no NVLink between them, but {labels[a]} and {labels[b]} do: "
            f"a partial NVLink mesh ({len(linked)} of {len(pairs)} pairs). tsgen's p2p kernels write to every "
            "peer directly and assume a full mesh; run on GPUs that form one (CUDA_VISIBLE_DEVICES), or set "
            "TSGEN_ALLOW_PARTIAL_MESH=1 to run over the slower path anyway")


@functools.lru_cache(maxsize=16)
def nvlink_matrix(bus_ids: tuple[str, ...]) -> tuple[tuple[bool, ...], ...] | None:
    """NVML's NVLink P2P status for every ordered pair of the GPUs with these PCI bus
    ids; None when NVML is not installed or cannot answer (no driver, old GPU)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml.NVMLError and friends: no driver, no library
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByPciBusId(b) for b in bus_ids]
        return tuple(
            tuple(i != j and pynvml.nvmlDeviceGetP2PStatus(h, g, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                  == pynvml.NVML_P2P_STATUS_OK for j, g in enumerate(handles))
            for i, h in enumerate(handles))
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def check_full_mesh(bus_ids: Sequence[str], env=os.environ) -> None:
    """Raise RuntimeSetupError on a partial NVLink mesh (see the module doc)."""
    if len(bus_ids) < 3 or env.get("TSGEN_ALLOW_PARTIAL_MESH") == "1":
        return  # two GPUs: one pair, nothing partial about it
    matrix = nvlink_matrix(tuple(bus_ids))
    if matrix is None:
        return
    problem = mesh_problem([f"rank {r} (GPU {b})" for r, b in enumerate(bus_ids)], matrix)
    if problem:
        raise RuntimeSetupError(problem)
