"""World: N GPUs, symmetric buffers, and manifest-driven launches.

A `World` owns a backend (how symmetric memory and the peer table are made)
and loads generated modules onto the ranks this process drives (`ranks`: all
of them in one process, its own with one process per GPU). A `Module` is one
generated source, compiled and loaded per device; `Module.alloc(count)` lays
out the manifest's buffers in one symmetric heap per rank; `Module.launch`
calls the kernel for this world size on the local ranks with the same leading
arguments (peers, rank, calls, count) and one pointer per buffer. Per-rank
things (devices, heap bases, peer tables, functions) are dicts keyed by
global rank. Nothing here knows about individual ops.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..env import force_no_multicast, shared_gpu_env
from ..errors import KernelFailed, RuntimeSetupError
from ..manifest import ALIGN, Arg, KernelEntry, Manifest, Slot, layout, np_dtype  # noqa: F401 (re-exported)
from .backends import Backend, cupy_or_error, make_backend
from .placement import mps_active, ranks_per_gpu, residency_problem, share_from_env

# C types of the scalar kernel arguments by role (every other argument is an address)
_ARG_RANGES = {"rank": ("int", -(1 << 31), (1 << 31) - 1), "count": ("uint64_t", 0, (1 << 64) - 1)}


def checked_args(args: Sequence[Arg], values: list[int]) -> list[int]:
    """`values` of a kernel's or launcher's `args`; RuntimeSetupError for a value its C type
    cannot hold (ctypes and NumPy would wrap -1 to 2**64 - 1 or fail deep inside)."""
    for a, v in zip(args, values):
        ctype, lo, hi = _ARG_RANGES.get(a.role, ("pointer", 0, (1 << 64) - 1))
        if not lo <= v <= hi:
            raise RuntimeSetupError(f"argument {a.name} = {v} does not fit a {ctype}")
    return values


def arg_values(args: Sequence[Arg], rank: int, count: int, base: int, offsets: Mapping[str, int],
               peer_table: int, host_peer_table: int) -> list[int]:
    """The value of each manifest argument of `rank`, by role: an address (the peer table on the
    device, `peers`, or its host copy, `peers_host`, for cudaMemcpyAsync; the call counter and the
    buffers: `base`, the rank's heap, plus the buffer's offset in it), the rank, or the count.
    Pure: every runtime that launches from a manifest (World's Buffers, tsgen.torch) uses it."""
    out = []
    for a in args:
        role = a.role
        if role == "peers":
            out.append(peer_table)
        elif role == "peers_host":
            out.append(host_peer_table)
        elif role == "rank":
            out.append(rank)
        elif role == "count":
            out.append(count)
        else:  # "calls" or a buffer: its place in this rank's heap
            out.append(base + offsets["calls" if role == "calls" else a.name])
    return out


def launcher_cargs(specs: Sequence[Arg], values: list[int]) -> list[Any]:
    """`values` of a host launcher's arguments as ctypes values (int rank, uint64 count, else an
    address), after checked_args; the caller appends the stream."""
    import ctypes

    wrap = {"rank": ctypes.c_int, "count": ctypes.c_uint64}
    return [wrap.get(a.role, ctypes.c_void_p)(v) for a, v in zip(specs, checked_args(specs, values))]


def check_array(array: Any, *, name: str, rank: int, device: int, dtype: str, elems: int) -> None:
    """Raise RuntimeSetupError unless `array` is a CuPy array of the right dtype,
    size and device for buffer `name` on `rank`. Pure: testable without a GPU."""
    where = f"buffer {name!r} of rank {rank}"
    if isinstance(array, np.ndarray):
        raise RuntimeSetupError(f"{where}: got a NumPy array on the host; pass a CuPy array on GPU {device}")
    if not hasattr(array, "device") or not hasattr(array, "dtype"):
        raise RuntimeSetupError(f"{where}: got {type(array).__name__}; pass a CuPy array on GPU {device}")
    want = np_dtype(dtype)
    if np.dtype(array.dtype) != want:
        raise RuntimeSetupError(f"{where}: dtype {np.dtype(array.dtype)} but the kernel takes {dtype}")
    if int(array.size) != elems:
        raise RuntimeSetupError(
            f"{where}: {int(array.size)} elements (shape {tuple(array.shape)}) but this call needs {elems}"
        )
    got = getattr(array.device, "id", array.device)
    if got != device:
        raise RuntimeSetupError(f"{where}: array is on GPU {got}, rank {rank} runs on GPU {device}")


def multimem_refusal(manifest: Manifest, env, multicast_supported: bool) -> str | None:
    """Why a module may not run here, or None. NVLink multicast (multimem) can take a
    shared host's GPUs down: it runs only where the device reports multicast support
    AND the user opted in with TSGEN_ALLOW_MULTIMEM=1 -- and even then this runtime
    has no multicast allocation yet, so it refuses with that reason. Pure: testable on CPU."""
    if not manifest.multimem:
        return None
    name = manifest.name
    if env.get("TSGEN_ALLOW_MULTIMEM") != "1":
        return (f"{name}: uses NVLink multicast (multimem), which tsgen never runs unless asked: "
                "set TSGEN_ALLOW_MULTIMEM=1 on a machine you own whose GPUs report multicast "
                "support. The non-multimem variants of this op compute the same result.")
    if not multicast_supported:
        return f"{name}: TSGEN_ALLOW_MULTIMEM=1, but the device reports no multicast support"
    return (f"{name}: multicast objects are not implemented by the single-process backend yet; "
            "use the non-multimem variant")


def device_lib_refusal(manifest: Manifest, backend: Any) -> str | None:
    """Why a device-linked module (manifest `device_libs`) cannot run on `backend`, or None.
    An nvshmem-transport kernel needs NVSHMEM initialized, its heap from nvshmem_malloc and
    nvshmemx_cumodule_init on the module: a backend says so with `nvshmem = True`. Pure."""
    if "nvshmem" in manifest.device_libs and not getattr(backend, "nvshmem", False):
        return (f"{manifest.name}: built for the NVSHMEM transport (params.transport: nvshmem), which "
                "runs only under the nvshmem backend (one process per GPU: `tsgen launch --nproc N -- tsgen test "
                "SPEC --backend nvshmem`), or use the p2p variant of the spec")
    return None


class Buffers:
    """The symmetric heap of one module for one `count`, on every rank."""

    def __init__(self, module: "Module", count: int):
        self.module, self.count = module, count
        self.slots, self.heap_bytes = module.manifest.layout(count, module.world.size)
        self.by_name = {s.name: s for s in self.slots}
        world = module.world
        # per local rank (world.ranks), keyed by global rank: heap base, peer table.
        # The backend owns the heap: if anything below fails, World.close frees it
        # (after telling the other processes, so none waits for this one).
        self.bases = world.backend.alloc_heap(self.heap_bytes)
        cp = world.cp
        for rank in world.ranks:
            with cp.cuda.Device(world.devices[rank]):
                for s in self.slots:
                    if s.role == "signal":
                        cp.cuda.runtime.memset(self.bases[rank] + s.offset, s.init_byte, s.nbytes)
                cp.cuda.runtime.deviceSynchronize()
        self.peer_tables = world.backend.peer_tables(self.bases)
        # host copies of the same tables (host launchers address peers with them)
        self.host_peer_tables = {r: np.asarray(t.get(), dtype=np.uint64) for r, t in self.peer_tables.items()}

    def array(self, name: str, rank: int):
        """CuPy view of buffer `name` on `rank` (no copy)."""
        s = self.by_name[name]
        world = self.module.world
        cp = world.cp
        mem = cp.cuda.UnownedMemory(self.bases[rank] + s.offset, s.nbytes, self, device_id=world.devices[rank])
        return cp.ndarray((s.elems,), dtype=np_dtype(s.dtype), memptr=cp.cuda.MemoryPointer(mem, 0))

    def set(self, name: str, rank: int, array: Any) -> None:
        """Copy a user array into buffer `name` of `rank`, after checking it fits."""
        s = self.by_name[name]
        world = self.module.world
        check_array(array, name=name, rank=rank, device=world.devices[rank], dtype=s.dtype, elems=s.elems)
        with world.cp.cuda.Device(world.devices[rank]):
            self.array(name, rank)[...] = array.reshape(-1)

    def arg_values(self, args: Sequence[Arg], rank: int) -> list[int]:
        """The value of each manifest argument for `rank` (see arg_values)."""
        return arg_values(args, rank, self.count, self.bases[rank], {n: s.offset for n, s in self.by_name.items()},
                          self.peer_tables[rank].data.ptr, self.host_peer_tables[rank].ctypes.data)

    def free(self) -> None:
        if self.bases:
            self.module.world.backend.free_heap(self.bases)
            self.bases = {}


def module_files(manifest: str | Path | Manifest, source: str | Path | None = None) -> tuple[Manifest, Path]:
    """The manifest and source of a module to load: `manifest` is the path of its NAME.json
    (read with Manifest.load, which checks every value and refuses another format version;
    the source is the NAME.cu it names, beside it, unless `source` is given; the manifest must
    describe that source: Manifest.check_source) or a Manifest in memory (tsgen.lowering)
    with `source`, the path of its rendered NAME.cu."""
    if isinstance(manifest, Manifest):
        if source is None:
            raise TypeError("World.load(Manifest): give source=, the path of the module's .cu")
        return manifest, Path(source)
    path = Path(manifest)
    loaded = Manifest.load(path)
    source = path.with_name(loaded.source) if source is None else Path(source)
    try:
        text = source.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise RuntimeSetupError(f"cannot read the source {source} that {path} names: {e.strerror or e}") from None
    loaded.check_source(text, source)
    return loaded, source


# The first launch of a kernel that calls printf (every tsgen kernel that waits: its timeout
# diagnostic) sets the context's printf buffer up, and the GPU runs nothing else meanwhile: it
# waits for every kernel already running (measured on an H100, docs/lab/experiments.md,
# docs/lab/shared_gpu.md). Where ranks share a GPU, one rank's first kernel would then wait for
# its peers' kernels, which spin until it has run. So a printf kernel runs once per device
# first. (Shared worlds still time out at some first calls for another reason, not yet found:
# a rank's host launcher call blocks; the lab log has what was measured.)
_PRIME_SOURCE = """// tsgen runtime: one launch sets the CUDA context's printf buffer up (tsgen/runtime/world.py)
#include <cstdio>
extern "C" __global__ void tsgen_prime_printf(int never) {
  if (never < 0) printf("tsgen: %d\\n", never);
}
"""
_primed: set[int] = set()


def prime_printf(cp: Any, devices: set[int], arch: str) -> None:
    """Launch a printf kernel once on each of `devices` (once per process) and wait for it."""
    from ..toolchain import compile_source, write_cached

    todo = sorted(devices - _primed)
    if not todo:
        return
    src = write_cached(("runtime",), "tsgen_prime_printf.cu", _PRIME_SOURCE)
    cubin = compile_source(src, arch=arch).output
    for dev in todo:
        with cp.cuda.Device(dev):
            kernel = cp.RawModule(path=str(cubin)).get_function("tsgen_prime_printf")
            kernel((1,), (1,), (np.int32(1),))
            cp.cuda.runtime.deviceSynchronize()
        _primed.add(dev)


class Module:
    """One generated source loaded on every rank of a World: its `manifest` (in memory, or
    read from NAME.json) and `source`, the NAME.cu it describes."""

    def __init__(self, world: "World", manifest: Manifest, source: Path, arch: str):
        from ..toolchain import compile_for

        self.world = world
        self.manifest = manifest
        self.source = Path(source)
        self.kernel = manifest.kernel(world.size)  # RuntimeSetupError naming the spec if not built for it
        refusal = multimem_refusal(manifest, os.environ, world.multicast_supported())
        if refusal:
            raise RuntimeSetupError(refusal)
        refusal = device_lib_refusal(manifest, world.backend)
        if refusal:
            raise RuntimeSetupError(refusal)
        self.device_libs = list(manifest.device_libs)
        if "nvshmem" not in self.device_libs:
            world.check_mesh()  # p2p kernels store into every peer: a partial NVLink mesh is refused
        cp = world.cp
        self.functions = {}  # per local rank
        self.launcher = None
        self._pool = None  # threads that call host launchers, one per local rank
        self._entries: dict[str, Any] = {}  # launch_entry's functions, by entry
        self._registered: list[int] = []  # CUmodule handles the backend registered (NVSHMEM)
        self.binary = compile_for(manifest, self.source, arch).output
        if world.shared:
            prime_printf(cp, set(world.devices.values()), arch)
        if manifest.compile_mode[0] == "shared":
            # The call is more than one kernel launch: the module's own host launcher
            # (compiled into a shared library) enqueues it on the stream we pass.
            self.launcher, prepare = _host_launcher(self.binary, self.kernel)
            if world.shared:  # persistent GEMM grids: one CTA per SM (their shared memory fills it)
                world.check_resident(self.kernel, None)
            if prepare is not None:  # before any rank's first call (KernelEntry.prepare says why)
                prepare_ranks(prepare, self.kernel.prepare, world.devices, manifest.name, cp.cuda.Device)
            return
        self._raw = {}  # the loaded modules, kept alive while registered
        for rank, dev in world.devices.items():
            with cp.cuda.Device(dev):
                mod = cp.RawModule(path=str(self.binary))
                self.functions[rank] = mod.get_function(self.kernel.name)  # loads it
                self._raw[rank] = mod
                if self.device_libs:  # device-linked NVSHMEM: nvshmemx_cumodule_init before any launch
                    world.backend.register_module(mod.module.ptr)
                    self._registered.append(mod.module.ptr)
        if manifest.blocks_wait or world.shared:
            world.check_resident(self.kernel, self.functions[world.ranks[0]])

    def alloc(self, count: int) -> Buffers:
        return Buffers(self, count)

    def launch(
        self,
        buffers: Buffers,
        ranks: Sequence[int] | None = None,
        streams: Sequence[Any] | None = None,
    ) -> None:
        """Launch the kernel on `ranks` (default: this process's) without waiting. The call
        number lives on the device (buffer `calls`), so launches may be captured
        in CUDA graphs and replayed.

        Without `streams`, each rank's kernel runs on its own stream (`world.streams`) but in
        order with the caller's work: it starts after what is already queued on the current
        stream of its device (inputs written with CuPy, say), and work queued there afterwards
        waits for every launched rank. With `streams`, the caller orders the work itself (the
        bench does, on the streams it times)."""
        world, cp = self.world, self.world.cp
        ranks = list(ranks if ranks is not None else world.ranks)
        world.launched.update({rank: f"{self.manifest.name}/{self.kernel.name}" for rank in ranks})
        ordered = streams is None
        streams = world.streams if streams is None else streams
        if ordered:
            self._follow_current_streams(ranks, streams)
        if self.launcher is not None:
            self._host_launch_all(buffers, ranks, streams)
        else:
            grid, block, smem = self.kernel.grid, self.kernel.block, self.kernel.shared_bytes
            for rank in ranks:
                values = checked_args(self.kernel.args, buffers.arg_values(self.kernel.args, rank))
                args = [np.int32(v) if a.role == "rank" else np.uint64(v) for a, v in zip(self.kernel.args, values)]
                with cp.cuda.Device(world.devices[rank]):
                    self.functions[rank](grid, block, tuple(args), shared_mem=smem, stream=streams[rank])
        if ordered:
            self._join_current_streams(ranks, streams)

    def _follow_current_streams(self, ranks: list[int], streams) -> None:
        """Each rank's stream waits for what is queued on its device's current stream. All of
        these waits come before any launch: ranks sharing a GPU must not wait for each other."""
        cp = self.world.cp
        for rank in ranks:
            with cp.cuda.Device(self.world.devices[rank]):
                current = cp.cuda.get_current_stream()
                if current.ptr != streams[rank].ptr:
                    streams[rank].wait_event(current.record())

    def _join_current_streams(self, ranks: list[int], streams) -> None:
        """Each device's current stream waits for every rank launched on that device."""
        cp = self.world.cp
        for rank in ranks:
            with cp.cuda.Device(self.world.devices[rank]):
                current = cp.cuda.get_current_stream()
                if current.ptr != streams[rank].ptr:
                    current.wait_event(streams[rank].record())

    def launch_entry(self, entry: str, buffers: Buffers, ranks: Sequence[int], streams: Sequence[Any],
                     extra: Callable[[int], Sequence[int]] | None = None) -> None:
        """Call one entry of a host-launch module whose call is several (moe: `<kernel>_dispatch_launch`,
        `<kernel>_combine_launch`): the launcher's arguments, then `extra(rank)` (pointers), then the
        stream, on every rank of `ranks` as `launch` calls the launcher (threads, never waiting)."""
        if self.launcher is None:
            raise RuntimeSetupError(f"{self.manifest.name}: entry {entry!r}: the module has no host launcher")
        if entry not in self._entries:
            import ctypes

            binary = self.binary
            fn = own_symbol(ctypes.CDLL(str(binary)), binary, f"{self.kernel.name}_{entry}_launch")
            fn.restype = ctypes.c_int
            self._entries[entry] = fn
        self._host_launch_all(buffers, list(ranks), streams, self._entries[entry], extra)

    def _host_launch_all(self, buffers: "Buffers", ranks: list[int], streams, fn=None,
                         extra: Callable[[int], Sequence[int]] | None = None) -> None:
        """Call the host launcher (or entry `fn`) of every rank. With one rank per GPU, each from its
        own thread: a launcher may block its thread inside a CUDA call until peers have launched too
        (measured: a cudaMemcpyAsync that reads a peer, or one queued on the legacy default stream
        behind a wait), which from a single thread never happens. Where ranks share a GPU, one
        after another from this thread, in rank order (sequential_launch says why)."""
        cp = self.world.cp

        def one(rank: int) -> None:
            with cp.cuda.Device(self.world.devices[rank]):
                self._host_launch(buffers, rank, streams[rank], fn, () if extra is None else extra(rank))

        if len(ranks) == 1 or sequential_launch(self.world.devices, ranks, side_streams=bool(self.kernel.prepare)):
            for rank in ranks:
                one(rank)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=len(self.world.ranks), thread_name_prefix="tsgen-launch")
        for future in [self._pool.submit(one, r) for r in ranks]:
            future.result()  # the first failing rank's error

    def close(self) -> None:
        """Stop the launch threads and drop the launch streams (World.close calls this)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for handle in self._registered:  # before the backend finalizes NVSHMEM
            self.world.backend.unregister_module(handle)
        self._registered.clear()

    def _host_launch(self, buffers: "Buffers", rank: int, stream: Any, fn=None, extra: Sequence[int] = ()) -> None:
        import ctypes

        specs = self.kernel.launcher_args
        args = launcher_cargs(specs, buffers.arg_values(specs, rank))
        args += [ctypes.c_void_p(p) for p in extra]
        args.append(ctypes.c_void_p(stream.ptr))
        err = (fn or self.launcher)(*args)
        if err != 0:
            raise RuntimeSetupError(
                f"rank {rank}: {getattr(fn, '__name__', None) or self.kernel.launcher} failed with cudaError {err} "
                f"({self.manifest.name}, count {buffers.count})"
            )


def sequential_launch(devices: Mapping[int, int], ranks: Sequence[int], side_streams: bool) -> bool:
    """Whether the host launchers of `ranks` are called from one thread, in rank order: where two of
    them share a GPU and the launcher enqueues kernels alone on the stream it is given (no side
    streams: a module whose launcher has them names a prepare, and may queue copies that hold its
    thread until a peer has launched). Measured on one H200 (docs/lab/shared_gpu.md, 2026-11-26):
    with a thread per rank, moe_ll hung at its first call in 6 of 8 runs at W 8 on one GPU and in 8
    of 14 at W 4 (moe at W 4: 1 of 2): every launcher call had returned within 1.5 ms, yet one
    rank's dispatch kernel never started, and its peers' waits for it timed out; from one thread,
    in rank order, 3 of 3 passed. Which driver step holds the kernel back was not found (a larger
    stack limit set before the first call made every run hang, also from one thread). Pure."""
    on = [devices[r] for r in ranks]
    return not side_streams and len(set(on)) < len(on)


CONTEXT_TRIES = 4  # a context refused for memory where test processes take turns on a GPU: tries in all


def first_streams(make: Callable[[], dict], error: type, processes_share: bool,
                  env: Mapping[str, str] = os.environ, sleep: Callable[[float], None] | None = None) -> dict:
    """`make()` (a World's first streams, which create its contexts), tried again where test processes
    take turns on the GPU (TSGEN_GPU_LOCK) and the context was refused for memory: the other workers'
    tests hold it for a while (a suite of 17 workers on one H200 had 31 tests fail so, 2026-11-26).
    Before each new try it waits for the GPU lock, so the test on the GPU has ended, then 1, 2, 3 s.
    Not for ranks of processes sharing a GPU (MPS: context_failure explains that refusal)."""
    import time

    lock = env.get("TSGEN_GPU_LOCK")
    for attempt in range(CONTEXT_TRIES):
        try:
            return make()
        except error as e:
            if (processes_share or not lock or attempt == CONTEXT_TRIES - 1
                    or not any(name in str(e) for name in ("cudaErrorMemoryAllocation", "out of memory"))):
                raise
            _wait_for_turn(lock)
            (sleep or time.sleep)(attempt + 1.0)
    raise AssertionError("unreachable")


def _wait_for_turn(path: str) -> None:
    """Take and give back the GPU lock (harness.gpu_turn's file)."""
    from ..files import held_lock

    with held_lock(Path(path)):
        pass


def prepare_ranks(prepare: Callable[[int, int], int], name: str, devices: dict[int, int], module: str,
                  device_scope: Callable[[int], Any]) -> None:
    """Call a host-launch module's `prepare(rank, device)` for every rank this process drives, in
    rank order, each inside `device_scope(device)` (CuPy's Device: prepare makes the rank's
    device current, and the caller's current device comes back after); a CUDA error stops it,
    named with the rank, the GPU and the module."""
    for rank in sorted(devices):
        with device_scope(devices[rank]):
            err = prepare(rank, devices[rank])
        if err != 0:
            raise RuntimeSetupError(f"rank {rank}: {name} failed with cudaError {err} ({module}, GPU {devices[rank]})")


def _host_launcher(library: Path, kernel: KernelEntry):
    """The `<kernel>_launch` function of a compiled module library and its `prepare(rank,
    device)` (None when the manifest names none), via ctypes; each must be the library's own
    (own_symbol)."""
    import ctypes

    lib = ctypes.CDLL(str(library))
    fn = own_symbol(lib, library, kernel.launcher)
    fn.restype = ctypes.c_int
    prepare = None
    if kernel.prepare:
        prepare = own_symbol(lib, library, kernel.prepare)
        prepare.restype = ctypes.c_int
        prepare.argtypes = [ctypes.c_int, ctypes.c_int]
    return fn, prepare


def own_symbol(lib: Any, library: Path, name: str) -> Any:
    """Function `name` of the loaded `library` (a ctypes.CDLL), only if the library itself defines
    it: dlsym also finds its dependencies' symbols (libc's `exit`), so dladdr must name the
    library's own file as the one that holds it. RuntimeSetupError otherwise."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise RuntimeSetupError(f"{library}: defines no function {name!r}") from None
    info = DlInfo()
    found = 0
    for libdl in (None, "libdl.so.2"):  # glibc >= 2.34 has dladdr in libc itself
        try:
            found = ctypes.CDLL(libdl).dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info))
            break
        except (OSError, AttributeError):
            continue
    try:
        own = bool(found) and info.dli_fname is not None and os.path.samefile(info.dli_fname.decode(), library)
    except OSError:
        own = False
    if not own:
        held = info.dli_fname.decode(errors="replace") if found and info.dli_fname else "an unknown object"
        raise RuntimeSetupError(f"{library}: {name!r} is not a function of this module (it resolves to {held}); "
                                "its manifest names the wrong functions")
    return fn


# The errors a client turned away by the MPS server was seen to get (the first two, 2026-11-26), and
# the ones CUDA names for it.
MPS_REFUSALS = ("cudaErrorMemoryAllocation", "cudaErrorDevicesUnavailable", "cudaErrorMpsMaxClientsReached",
                "cudaErrorMpsMaxConnectionsReached")


def context_failure(error: Exception, devices: dict[int, int], processes_share: bool,
                    env: Mapping[str, str] = os.environ) -> str:
    """What to say when a rank's first CUDA context could not be made. Under MPS (`processes_share`:
    ranks in several processes on one GPU) a client that the server turns away gets a misleading
    cudaErrorMemoryAllocation or cudaErrorDevicesUnavailable, and its server log says "Reached
    maximum number of device connections": every client's hardware queues come from one pool per
    GPU, and CUDA_DEVICE_MAX_CONNECTIONS=32 in every rank let only 3 ranks in on an H200
    (measured 2026-11-26, docs/lab/shared_gpu.md). Pure given `env`."""
    where = ", ".join(f"rank {r} on GPU {d}" for r, d in sorted(devices.items()))
    text = f"{where}: creating the CUDA context failed: {error}"
    refusal = any(name in str(error) for name in MPS_REFUSALS)
    if not processes_share or not refusal or not mps_active(env):
        return text
    text += ("; under MPS this may be how the server turned this client away because the GPU's hardware "
             "queues are taken (its log, in CUDA_MPS_LOG_DIRECTORY, then says 'Reached maximum number of "
             "device connections')")
    connections = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if connections:
        text += (f": this process asks for CUDA_DEVICE_MAX_CONNECTIONS={connections}; unset it (a tsgen rank "
                 "needs the driver's default) or run fewer processes per GPU")
    else:
        text += ": run fewer processes per GPU, or stop other MPS clients"
    return text


class World:
    """`size` GPUs driven by one backend; this process drives `ranks` of them (all of
    them with the single-process backend, its own with "ipc" or "nvshmem"). Per-rank things are
    keyed by global rank. The context manager frees what it made; leaving it with an
    exception also tells the other processes (if any) to stop waiting."""

    def __init__(self, size: int | None = None, backend: Backend | str | None = "single",
                 share_gpus: bool | None = None):
        force_no_multicast()  # before any CUDA library (NCCL, NVSHMEM, torch) is loaded
        if share_gpus is None:
            share_gpus = share_from_env()
        if share_gpus:  # before the first context (tsgen/env.py says why)
            shared_gpu_env(rank_per_process=isinstance(backend, str) and backend != "single")
        self.cp = cupy_or_error()
        if backend is None or isinstance(backend, str):
            backend = make_backend(backend or "single", size, self.cp, share_gpus=share_gpus)
        if size is not None and backend.size != size:
            raise RuntimeSetupError(f"world size {size} asked for, but the backend has {backend.size} ranks")
        self.backend = backend
        self.size = backend.size
        self.devices = backend.devices  # {rank: CUDA device} for this process's ranks
        self.ranks = sorted(self.devices)
        # ranks on the busiest GPU (over the whole world: with one process per rank, its peers')
        self.colocated = ranks_per_gpu(list(backend.bus_ids))
        self.shared = self.colocated > 1
        # One non-blocking stream per local rank, on its device: every launch path uses it unless
        # the caller passes others. Never the legacy default stream: ranks sharing a GPU would be
        # serialized behind each other (a hang when one waits for the other), and peer copies
        # queued there ordered separate devices' default streams against each other (deadlock).
        self._modules: list[Module] = []  # closed with the World
        self.launched: dict[int, str] = {}  # rank -> "module/kernel" it last launched (synchronize names it)
        self.cleanup_errors: list[str] = []  # what closing after an error raised (kept, not raised)
        try:  # the first call that creates this process's context on each device
            self.streams = first_streams(self.make_streams, self.cp.cuda.runtime.CUDARuntimeError,
                                         processes_share=self.shared and backend.store is not None)
        except self.cp.cuda.runtime.CUDARuntimeError as e:
            error = RuntimeSetupError(context_failure(e, self.devices, self.shared and backend.store is not None))
            self.__exit__(RuntimeSetupError, error, None)  # the peers stop waiting for this rank
            raise error from None

    def make_streams(self) -> dict[int, Any]:
        """A new non-blocking stream per local rank, on its device, keyed by rank."""
        out = {}
        for rank, dev in self.devices.items():
            with self.cp.cuda.Device(dev):
                out[rank] = self.cp.cuda.Stream(non_blocking=True)
        return out

    @property
    def is_root(self) -> bool:
        """True in the process that drives rank 0 (the one that prints summaries)."""
        return 0 in self.devices

    def barrier(self, label: str) -> None:
        """Every process gets here before any goes on (nothing to do in one process)."""
        if self.backend.store is not None:
            self.backend.store.barrier(label)

    def exchange(self, label: str, value: Any) -> list[Any]:
        """Every process's JSON-able `value`, in rank order ([value] in one process)."""
        if self.backend.store is None:
            return [value]
        return [json.loads(v) for v in self.backend.store.all_gather(label, json.dumps(value).encode())]

    def check_mesh(self) -> None:
        """Refuse kernels that load and store peer memory where some peer is not reachable
        by NVLink (a partial mesh, or ranks on several hosts)."""
        from .topology import check_full_mesh

        problem = getattr(self.backend, "mesh_problem", None)
        if problem:
            raise RuntimeSetupError(problem)
        check_full_mesh(list(dict.fromkeys(self.backend.bus_ids)))  # ranks sharing a GPU: one entry

    def load(self, manifest: str | Path | Manifest, arch: str = "sm_90a", source: str | Path | None = None) -> Module:
        """Load a generated module on this process's ranks (see module_files)."""
        module = Module(self, *module_files(manifest, source), arch)
        self._modules.append(module)
        return module

    def multicast_supported(self) -> bool:
        """The device attribute (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 132); False if unknown.
        Only read: nothing here creates a multicast object."""
        try:
            return bool(self.cp.cuda.runtime.deviceGetAttribute(132, self.devices[self.ranks[0]]))
        except Exception:
            return False

    def synchronize(self) -> None:
        """Wait for this process's ranks. Kernels that failed raise one KernelFailed naming, per
        failed GPU, its ranks, the kernel each last launched and CUDA's error (every GPU is waited
        for first: a peer of a failed rank times out and traps too, and says what it waited for)."""
        on_gpu: dict[int, list[int]] = {}
        for rank, dev in sorted(self.devices.items()):
            on_gpu.setdefault(dev, []).append(rank)
        failed = []
        for dev, ranks in on_gpu.items():
            try:
                with self.cp.cuda.Device(dev):
                    self.cp.cuda.runtime.deviceSynchronize()
            except self.cp.cuda.runtime.CUDARuntimeError as e:
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                kernels = ", ".join(dict.fromkeys(self.launched[r] for r in ranks if r in self.launched))
                failed.append(f"{who} (GPU {dev}{', kernel ' + kernels if kernels else ''}): {e}")
        if failed:
            raise KernelFailed("kernel failed on " + "; ".join(failed))

    def check_resident(self, kernel: KernelEntry, function: Any) -> None:
        """Kernels whose blocks wait on each other (or, on a shared GPU, on other ranks) need
        every block of every co-located rank resident at once. `function` None: a host-launched
        persistent kernel, counted at one block per SM."""
        cp = self.cp
        blocks = kernel.grid[0]
        threads = kernel.block[0]
        props = cp.cuda.runtime.getDeviceProperties(self.devices[self.ranks[0]])
        sms = props["multiProcessorCount"]
        if function is None:
            per_sm = 1
        else:
            try:
                per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    function.ptr, threads, kernel.shared_bytes
                )
            except Exception:  # older CuPy: bound by threads alone
                per_sm = max(1, props["maxThreadsPerMultiProcessor"] // threads)
        problem = residency_problem(kernel.name, blocks, self.colocated, sms, per_sm)
        if problem:
            raise RuntimeSetupError(problem)

    def close(self) -> None:
        for module in self._modules:
            module.close()
        self._modules.clear()
        self.backend.close()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        if self.backend.store is not None:
            self.backend.store.abort(f"{exc_type.__name__}: {exc}")
        try:  # after a kernel failed, freeing fails too (the context is lost): the first error is the one to see
            self.close()
        except Exception as e:  # noqa: BLE001
            self.cleanup_errors.append(f"{type(e).__name__}: {e}")
