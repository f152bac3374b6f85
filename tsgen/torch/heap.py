"""Symmetric heaps for tsgen kernels inside a PyTorch program, made on a torch.distributed group.

A generated kernel takes `peers` (every rank's heap base as this rank addresses it) and pointers
into its own heap, laid out as the manifest says (tsgen.manifest.layout: the same offsets on
every rank). Two ways to get such a heap, both collective over the group:

  symm_mem  torch.distributed._symmetric_memory: `empty` + `rendezvous` map every peer's
            allocation into this process (`buffer_ptrs`). The allocation may sit at an offset in
            a block of torch's symmetric pool, so each rank's offset is exchanged and the peer
            table names each rank's heap itself, not its block.
  ipc       where symmetric memory is missing or fails (an old torch, a container that forbids
            the file-descriptor exchange): one cuMemAlloc per rank (outside torch's caching
            allocator, so the CUDA IPC handle names exactly this allocation), its handle sent to
            every rank with all_gather_object, the peers' handles opened with
            cuIpcOpenMemHandle. Driver API through ctypes, no CuPy.

Either way the heap is zeroed (signals start at 0, or at their init byte), the device synchronized,
and only then do the ranks exchange: a peer's kernel writes into this heap only after that
exchange, so it never races the zeroing. NVLink multicast is never asked for; a handle that
came with a multicast address is refused.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .signature import TsgenTorchError

HEAP_ENV = "TSGEN_TORCH_HEAP"
MODES = ("auto", "symm_mem", "ipc")


def heap_mode(asked: str | None = None, env=os.environ) -> str:
    """The heap mode: `asked`, else TSGEN_TORCH_HEAP, else auto (symm_mem, falling back to ipc)."""
    mode = asked or env.get(HEAP_ENV) or "auto"
    if mode not in MODES:
        raise TsgenTorchError(f"heap mode {mode!r} ({HEAP_ENV} or load(heap=...)): use one of {', '.join(MODES)}")
    return mode


def all_gather(group: Any, value: Any) -> list[Any]:
    """Every rank's picklable `value`, in group-rank order (host-blocking: a barrier too)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(group: Any, problem: str | None) -> None:
    """Raise on every rank when any rank has a problem (its text named with its rank): a rank that
    raised alone would leave the others waiting in the next collective."""
    problems = [(r, p) for r, p in enumerate(all_gather(group, problem)) if p]
    if problems:
        raise TsgenTorchError("; ".join(f"rank {r}: {p}" for r, p in problems))


@dataclass
class Heap:
    """One rank's symmetric heap: `tensor` (uint8, the heap's bytes on this GPU); every rank's heap
    base as mapped in this process in `peer_table` on the device (the kernels' `peers`) and in
    `host_table` in host memory (`peers_host`, copy-engine launchers)."""

    kind: str
    tensor: torch.Tensor
    peer_table: torch.Tensor
    host_table: Any
    _close: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The heap's bytes [offset, offset + nbytes) as a 1-d tensor of `dtype` (no copy)."""
        return self.tensor[offset:offset + nbytes].view(dtype)

    def close(self) -> None:
        """Release the heap (collective for ipc heaps: every rank closes its mappings first)."""
        if self._close is not None:
            close, self._close = self._close, None
            close()


def _tables(peers: list[int], device: int) -> tuple[torch.Tensor, Any]:
    return torch.tensor(peers, dtype=torch.int64, device=f"cuda:{device}"), (ctypes.c_uint64 * len(peers))(*peers)


def _prepare(tensor: torch.Tensor, init: Callable[[torch.Tensor], None], device: int) -> None:
    tensor.zero_()
    init(tensor)
    torch.cuda.synchronize(device)  # before any peer may write here (after the exchange)


# -- torch symmetric memory -------------------------------------------------------------------

def _symm_mem_heap(nbytes: int, group: Any, device: int, init: Callable[[torch.Tensor], None]) -> Heap:
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    name = group.group_name
    tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    _prepare(tensor, init, device)
    try:
        handle = symm_mem.rendezvous(tensor, name)
    except Exception:  # torch 2.4-2.5 want the group enabled first (deprecated, and unneeded, later)
        if not hasattr(symm_mem, "enable_symm_mem_for_group"):
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(name)
        handle = symm_mem.rendezvous(tensor, name)
    if int(getattr(handle, "multicast_ptr", 0) or 0):
        raise TsgenTorchError("symmetric memory set up NVLink multicast although TORCH_SYMM_MEM_DISABLE_MULTICAST=1; "
                              "tsgen never runs with multicast")
    ptrs = [int(p) for p in handle.buffer_ptrs]
    offset = tensor.data_ptr() - ptrs[rank]
    size = int(getattr(handle, "buffer_size", offset + nbytes))
    if len(ptrs) != world or not 0 <= offset <= size - nbytes:
        raise TsgenTorchError(f"symmetric memory gave {len(ptrs)} buffer pointers and this rank's tensor at offset "
                              f"{offset} of a {size}-byte buffer; expected {world} and a {nbytes}-byte heap inside")
    offsets = all_gather(group, offset)  # each rank's heap inside its own block
    peers = [p + o for p, o in zip(ptrs, offsets)]
    table, host = _tables(peers, device)
    keep = [tensor, handle]

    def close() -> None:
        keep.clear()  # torch frees the allocation with the last reference

    return Heap("symm_mem", tensor, table, host, close)


# -- CUDA IPC through the driver API ----------------------------------------------------------

class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # c_ubyte: a c_char array would stop at a zero byte


class _Driver:
    """The few driver calls an ipc heap needs, on the calling thread's current context (the
    device's primary context, which torch makes current)."""

    _lib = None

    def __init__(self):
        if _Driver._lib is None:
            try:
                _Driver._lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise TsgenTorchError(f"cannot load the CUDA driver (libcuda.so.1) for CUDA IPC: {e}") from None
        self.lib = _Driver._lib

    def call(self, fn: str, *args: Any) -> None:
        res = getattr(self.lib, fn)(*args)
        if res != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(res, ctypes.byref(text))
            raise TsgenTorchError(f"{fn} failed: CUDA driver error {res} ({(text.value or b'?').decode()})")


class _DeviceBytes:
    """A device allocation seen by torch through __cuda_array_interface__ (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def _ipc_heap(nbytes: int, group: Any, device: int, init: Callable[[torch.Tensor], None]) -> Heap:
    drv = _Driver()
    rank = dist.get_rank(group)
    base = ctypes.c_uint64(0)
    opened: dict[int, int] = {}

    def release(barrier: bool) -> None:
        problems = []
        for r, ptr in sorted(opened.items()):
            try:
                drv.call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))
            except TsgenTorchError as e:
                problems.append(f"closing rank {r}'s heap: {e}")
        opened.clear()
        if barrier:  # no peer may still map the heap when it is freed
            all_gather(group, None)
        if base.value:
            try:
                drv.call("cuMemFree_v2", base)
            except TsgenTorchError as e:
                problems.append(f"freeing the heap: {e}")
            base.value = 0
        if problems:
            raise TsgenTorchError(f"rank {rank}: " + "; ".join(problems))

    try:  # any failure here is agreed on below: a rank that raised alone would leave the others waiting
        drv.call("cuMemAlloc_v2", ctypes.byref(base), ctypes.c_size_t(nbytes))
        tensor = torch.as_tensor(_DeviceBytes(base.value, nbytes), device=f"cuda:{device}")
        _prepare(tensor, init, device)
        handle = _IpcHandle()
        drv.call("cuIpcGetMemHandle", ctypes.byref(handle), base)
        problem = None
    except Exception as e:
        tensor, handle, problem = None, None, f"allocating a {nbytes}-byte CUDA IPC heap on GPU {device}: {e}"
    got = all_gather(group, None if problem else (bytes(handle), nbytes))
    try:
        bad = [r for r, g in enumerate(got) if g is None]
        if bad:
            raise TsgenTorchError(problem or f"rank(s) {', '.join(map(str, bad))} could not allocate their heap")
        peers = []
        for r, (raw, size) in enumerate(got):
            if r == rank:
                peers.append(base.value)
                continue
            if size != nbytes:
                raise TsgenTorchError(f"rank {r}'s heap is {size} bytes, rank {rank}'s {nbytes}: the ranks called the "
                                      "op with different shapes")
            ptr = ctypes.c_uint64()
            drv.call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), _IpcHandle.from_buffer_copy(raw),
                     ctypes.c_uint(1))  # lazy peer access
            opened[r] = ptr.value
            peers.append(ptr.value)
        problem = None
    except TsgenTorchError as e:
        problem = str(e)
    try:
        agree(group, problem)
    except TsgenTorchError:
        release(barrier=False)
        raise
    table, host = _tables(peers, device)
    return Heap("ipc", tensor, table, host, lambda: release(barrier=True))


# -- the choice --------------------------------------------------------------------------------

def make_heap(nbytes: int, group: Any, device: int, mode: str, init: Callable[[torch.Tensor], None]
              ) -> tuple[Heap, str | None]:
    """A symmetric heap of `nbytes` on every rank of `group` (collective), and why symmetric memory was
    not used where `mode` is auto and it failed (None otherwise). `init(tensor)` sets the signals'
    first values after the heap is zeroed."""
    if mode == "ipc":
        return _ipc_heap(nbytes, group, device, init), None
    heap, problem = None, None
    try:
        heap = _symm_mem_heap(nbytes, group, device, init)
    except Exception as e:  # noqa: BLE001 - any failure: every rank agrees below, then falls back or raises
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    problems = [(r, p) for r, p in enumerate(all_gather(group, problem)) if p]
    if not problems:
        return heap, None
    if heap is not None:
        heap.close()
    why = "; ".join(f"rank {r}: {p}" for r, p in problems)
    if mode == "symm_mem":
        raise TsgenTorchError(f"torch symmetric memory failed ({why})")
    return _ipc_heap(nbytes, group, device, init), why
