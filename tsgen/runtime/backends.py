"""Backends: how symmetric memory and the peer table are made.

Kernels see the same arguments whatever the backend: a table of every
rank's heap base as this rank can address it, and pointers into its own
heap. A backend knows the world's `size`, the `devices` of the ranks this
process drives ({rank: CUDA device}: every rank in one process, one rank per
process otherwise), the PCI bus ids of every rank's GPU, and the `store`
through which its processes meet (None for one process). It allocates one
heap per local rank with the same size, and says where each peer's heap
appears from each local rank. One process driving every GPU with peer
access is here; one process per GPU with CUDA IPC handles is in ipc.py;
one process per GPU with NVSHMEM (nvshmem_malloc'd heap, nvshmem_ptr for
peers, device-linked modules registered) is in nvshmem.py.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from ..errors import CUDA_EXTRAS_HINT, RuntimeSetupError

def cupy_or_error():
    try:
        import cupy
    except ImportError as e:
        raise RuntimeSetupError(
            f"running kernels needs CuPy for your driver's CUDA version: {CUDA_EXTRAS_HINT} ({e})"
        ) from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise RuntimeSetupError(f"no usable CUDA device: {e}") from None
    if n == 0:
        raise RuntimeSetupError("no CUDA device is visible")
    return cupy


class Backend(Protocol):
    size: int  # ranks in the world
    devices: dict[int, int]  # rank -> CUDA device, for the ranks this process drives
    bus_ids: list[str]  # PCI bus id of every rank's GPU (topology checks)
    store: Any  # tsgen.runtime.store.Rendezvous when the ranks live in several processes, else None

    def alloc_heap(self, nbytes: int) -> dict[int, int]: ...  # {local rank: heap base}

    def peer_tables(self, bases: dict[int, int]) -> dict[int, Any]: ...  # {local rank: device table}

    def free_heap(self, bases: dict[int, int]) -> None: ...

    def close(self) -> None: ...


BACKENDS = ("single", "ipc", "nvshmem")
PER_PROCESS = ("ipc", "nvshmem")  # one process per GPU, started by a launcher


def world_size(backend: str, size: int | None, env=os.environ) -> int:
    """The world size a run will have: `size` for one process (required), the
    launcher's for one process per GPU (`size`, if given, must agree). Needs no GPU."""
    if backend == "single":
        if size is None:
            raise RuntimeSetupError("the single-process backend needs the world size: give --gpus N")
        return size
    if backend in PER_PROCESS:
        from .ipc import launcher_world

        return launcher_world(env, size).size
    raise RuntimeSetupError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def make_backend(name: str, size: int | None, cp, share_gpus: bool = False) -> Backend:
    size = world_size(name, size)
    if name == "ipc":
        from .ipc import IpcBackend

        return IpcBackend(cp, size, share_gpus=share_gpus)
    if name == "nvshmem":
        if share_gpus:
            raise RuntimeSetupError(
                "the nvshmem backend does not run ranks that share a GPU (NVSHMEM limits itself to one PE "
                "per GPU without MPS): test on one GPU with the single-process backend "
                "(`tsgen test SPEC --gpus N --share-gpus`) or give each rank its own GPU")
        from .nvshmem import NvshmemBackend

        return NvshmemBackend(cp, size)
    return SingleProcessBackend(size, cp, share_gpus=share_gpus)


class SingleProcessBackend:
    """One process, GPUs 0..size-1 (or `devices`), peer access between every pair of distinct
    GPUs. With `share_gpus`, rank r runs on visible GPU r % G (placement.place_ranks)."""

    store = None

    def __init__(self, size: int, cp, devices: list[int] | None = None, share_gpus: bool = False):
        from .placement import place_ranks

        self.cp, self.size = cp, size
        available = cp.cuda.runtime.getDeviceCount()
        if devices is None:
            shown = (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                     if "CUDA_VISIBLE_DEVICES" in os.environ else "")
            devices = place_ranks(size, available, share_gpus, shown)
        devices = list(devices)
        if len(devices) != size:
            raise RuntimeSetupError(f"world size {size} but {len(devices)} devices given")
        if max(devices) >= available:
            raise RuntimeSetupError(f"GPU {max(devices)} asked for, but this machine shows {available}")
        self.devices = dict(enumerate(devices))
        rt = cp.cuda.runtime
        self.bus_ids = [rt.deviceGetPCIBusId(d) for d in devices]
        distinct = sorted(set(devices))
        for i in distinct:
            for j in distinct:
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
        self._heaps: list[dict[int, int]] = []

    def alloc_heap(self, nbytes: int) -> dict[int, int]:
        rt = self.cp.cuda.runtime
        bases: dict[int, int] = {}
        try:
            for rank, dev in self.devices.items():
                with self.cp.cuda.Device(dev):
                    bases[rank] = rt.malloc(nbytes)  # outside CuPy's pool: exact bases
        except rt.CUDARuntimeError as e:
            self.free_heap(bases)
            raise RuntimeSetupError(f"allocating a {nbytes}-byte symmetric heap per rank: {e}") from None
        self._heaps.append(bases)
        return bases

    def peer_tables(self, bases: dict[int, int]) -> dict[int, Any]:
        # Unified addressing: a peer's pointer is valid as-is once peer access is on.
        every = [bases[r] for r in range(self.size)]
        tables = {}
        for rank, dev in self.devices.items():
            with self.cp.cuda.Device(dev):
                tables[rank] = self.cp.asarray(every, dtype=self.cp.uint64)
        return tables

    def free_heap(self, bases: dict[int, int]) -> None:
        for rank, ptr in bases.items():
            with self.cp.cuda.Device(self.devices[rank]):
                self.cp.cuda.runtime.free(ptr)
        if bases in self._heaps:
            self._heaps.remove(bases)

    def close(self) -> None:
        for bases in list(self._heaps):
            self.free_heap(bases)
