"""Backends: how symmetric memory and the peer table are made.

Kernels see the same arguments whatever the backend: a table of every
rank's heap base as this rank can address it, and pointers into its own
heap. A backend only has to allocate one heap per rank with the same size,
and say where each peer's heap appears from each rank. One process driving
every GPU with peer access is here; one process per GPU (CUDA IPC handles:
each rank maps its peers' heaps) and NVSHMEM (nvshmem_malloc'd heap,
nvshmem_ptr for peers) fit the same four methods.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from ..errors import RuntimeSetupError

# NVLink multicast (NVLS) is never used at run time on shared machines; keep
# the libraries we may load in the same process from turning it on.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _key, _value in SAFE_ENV.items():
    os.environ.setdefault(_key, _value)


def cupy_or_error():
    try:
        import cupy
    except ImportError as e:
        raise RuntimeSetupError(
            "running kernels needs CuPy: `pip install tsgen[cuda13]` (or [cuda12]) "
            f"for your driver's CUDA version ({e})"
        ) from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise RuntimeSetupError(f"no usable CUDA device: {e}") from None
    if n == 0:
        raise RuntimeSetupError("no CUDA device is visible")
    return cupy


class Backend(Protocol):
    devices: list[int]

    def alloc_heap(self, nbytes: int) -> list[int]: ...

    def peer_tables(self, bases: list[int]) -> list[Any]: ...

    def free_heap(self, bases: list[int]) -> None: ...

    def close(self) -> None: ...


class SingleProcessBackend:
    """One process, GPUs 0..size-1 (or `devices`), peer access between every pair."""

    def __init__(self, size: int, cp, devices: list[int] | None = None):
        self.cp = cp
        available = cp.cuda.runtime.getDeviceCount()
        self.devices = list(devices) if devices is not None else list(range(size))
        if len(self.devices) != size:
            raise RuntimeSetupError(f"world size {size} but {len(self.devices)} devices given")
        if max(self.devices) >= available:
            raise RuntimeSetupError(
                f"world size {size} needs {size} GPUs, but this machine shows {available}"
                + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in os.environ else "")
            )
        rt = cp.cuda.runtime
        for i in self.devices:
            for j in self.devices:
                if i == j:
                    continue
                if not rt.deviceCanAccessPeer(i, j):
                    raise RuntimeSetupError(
                        f"GPU {i} cannot access GPU {j} directly (no peer access); tsgen's p2p "
                        "kernels need every pair connected (NVLink or PCIe P2P)"
                    )
                with cp.cuda.Device(i):
                    try:
                        rt.deviceEnablePeerAccess(j)
                    except rt.CUDARuntimeError as e:
                        if "PeerAccessAlreadyEnabled" not in str(e):
                            raise RuntimeSetupError(f"enabling peer access GPU {i} -> {j}: {e}") from None
        self._heaps: list[list[int]] = []

    def alloc_heap(self, nbytes: int) -> list[int]:
        rt = self.cp.cuda.runtime
        bases = []
        try:
            for dev in self.devices:
                with self.cp.cuda.Device(dev):
                    bases.append(rt.malloc(nbytes))  # outside CuPy's pool: exact bases
        except rt.CUDARuntimeError as e:
            self.free_heap(bases)
            raise RuntimeSetupError(f"allocating a {nbytes}-byte symmetric heap per rank: {e}") from None
        self._heaps.append(bases)
        return bases

    def peer_tables(self, bases: list[int]) -> list[Any]:
        # Unified addressing: a peer's pointer is valid as-is once peer access is on.
        tables = []
        for dev in self.devices:
            with self.cp.cuda.Device(dev):
                tables.append(self.cp.asarray(bases, dtype=self.cp.uint64))
        return tables

    def free_heap(self, bases: list[int]) -> None:
        for dev, ptr in zip(self.devices, bases):
            with self.cp.cuda.Device(dev):
                self.cp.cuda.runtime.free(ptr)
        if bases in self._heaps:
            self._heaps.remove(bases)

    def close(self) -> None:
        for bases in list(self._heaps):
            self.free_heap(bases)
