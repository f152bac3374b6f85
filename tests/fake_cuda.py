"""A fake CuPy under the real World, Module and Buffers, for one `tsgen` command run in a child
process (tests/test_kernel_failure_cpu.py): GPUs with byte arrays for memory, and a kernel that
fails the way a trapped wait does. A launch on a GPU of FAIL_GPUS (TSGEN_FAKE_FAIL_GPUS, a
comma list) prints the kernel's timeout diagnosis to fd 1, as the device printf does, and
leaves that GPU's context lost: from then on every call on it raises cudaErrorLaunchFailure,
freeing memory included (CUDA's sticky error).

    python tests/fake_cuda.py tsgen ARGS...
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import numpy as np


class CUDARuntimeError(RuntimeError):
    pass


STICKY = "cudaErrorLaunchFailure: unspecified launch failure"


class Runtime:
    CUDARuntimeError = CUDARuntimeError

    def __init__(self, gpus: int, fail: set[int]):
        self.gpus, self.fail, self.lost = gpus, fail, set()
        self.current, self.next, self.memory = 0, 1 << 20, {}  # base -> (gpu, bytes)

    def _alive(self, gpu=None):
        if (self.current if gpu is None else gpu) in self.lost:
            raise CUDARuntimeError(STICKY)

    def getDeviceCount(self):
        return self.gpus

    def deviceGetPCIBusId(self, d):
        return f"0000:{d + 1:02x}:00.0"

    def deviceCanAccessPeer(self, i, j):
        return 1

    def deviceEnablePeerAccess(self, j):
        pass

    def getDeviceProperties(self, d):
        return {"name": b"Fake H100", "multiProcessorCount": 132, "maxThreadsPerMultiProcessor": 2048}

    def deviceGetAttribute(self, attr, d):
        return 0

    def deviceSynchronize(self):
        self._alive()

    def malloc(self, n):
        self._alive()
        base, self.next = self.next, self.next + n + 4096
        self.memory[base] = (self.current, np.zeros(n, np.uint8))
        return base

    def free(self, ptr):
        self._alive(self.memory[ptr][0])
        del self.memory[ptr]

    def memset(self, ptr, value, n):
        self._alive()
        self.view(ptr, n)[...] = value

    def view(self, ptr, n) -> np.ndarray:
        base = max(b for b in self.memory if b <= ptr)
        return self.memory[base][1][ptr - base:ptr - base + n]


class Array(np.ndarray):
    def set(self, a):
        self[...] = a

    def get(self, stream=None):
        return np.asarray(self).copy()


class Event:
    pass


class Stream:
    _next = 1

    def __init__(self, non_blocking=False):
        self.ptr, Stream._next = Stream._next, Stream._next + 1

    def record(self):
        return Event()

    def wait_event(self, event):
        pass


def fake_cupy(gpus: int, fail: set[int]):
    rt = Runtime(gpus, fail)
    default = Stream()

    @contextlib.contextmanager
    def device(i):
        old, rt.current = rt.current, i
        try:
            yield
        finally:
            rt.current = old

    class Kernel:
        def __init__(self, name):
            self.name, self.ptr = name, id(self)

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            rt._alive()
            if rt.current in rt.fail:  # the wait times out: the diagnosis, then the trap
                rank = int(args[1])
                os.write(1, f"tsgen: timeout: rank {rank} block 0 thread 0 waited 10000 ms on ready[0] "
                            f"(memory of rank {(rank + 1) % 2}) for >= 1, saw 0\n".encode())
                rt.lost.add(rt.current)

    class RawModule:
        def __init__(self, path=None, **kw):
            self.module = types.SimpleNamespace(ptr=1)

        def get_function(self, name):
            return Kernel(name)

    class Memory:
        def __init__(self, ptr, size, owner, device_id=None):
            self.ptr, self.size = ptr, size

    def ndarray(shape, dtype, memptr):
        mem = memptr.mem
        return rt.view(mem.ptr, mem.size).view(dtype).reshape(shape).view(Array)

    def asarray(values, dtype=None):  # the peer tables: a device address and a copy back
        host = np.asarray(values, dtype=dtype)
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=rt.malloc(host.nbytes)), get=host.copy)

    cuda = types.SimpleNamespace(
        runtime=rt, Device=device, Stream=Stream, get_current_stream=lambda: default,
        UnownedMemory=Memory, MemoryPointer=lambda mem, offset: types.SimpleNamespace(mem=mem),
        driver=types.SimpleNamespace())  # no occupancy API: the runtime bounds residency by threads
    return types.SimpleNamespace(cuda=cuda, RawModule=RawModule, ndarray=ndarray, asarray=asarray,
                                 uint64=np.uint64, __version__="0-fake")


def install(gpus: int = 2, fail: set[int] = frozenset()) -> None:
    """The fake CuPy in sys.modules, and compile_for giving a file name without nvcc."""
    import tsgen.toolchain

    sys.modules["cupy"] = fake_cupy(gpus, set(fail))
    tsgen.toolchain.compile_for = lambda manifest, source, arch="sm_90a": types.SimpleNamespace(
        output=Path(source).with_suffix(".cubin"))


if __name__ == "__main__":
    fail = {int(g) for g in os.environ.get("TSGEN_FAKE_FAIL_GPUS", "").split(",") if g}
    install(int(os.environ.get("TSGEN_FAKE_GPUS", "2")), fail)
    from tsgen.cli import main

    sys.argv = sys.argv[1:]
    main()
