"""One process per GPU with NVSHMEM symmetric memory (nvshmem4py).

Each process is one NVSHMEM PE and drives one rank (PE = rank). Who it is
comes from torch.distributed's default process group or the launcher's
environment, as for the ipc backend; the ranks meet through the same store
(the group's, torchrun's or tsgen's: tsgen.runtime.store), which also carries
NVSHMEM's unique id from rank 0 to the others (`nvshmem.core.init(...,
initializer_method="uid")`).

A heap is one `nvshmem.core.array` of bytes: nvshmem_malloc, the same offset
on every PE, so a kernel's buffer pointers are symmetric addresses that
NVSHMEM device calls translate for any target PE (`transport: nvshmem`).
The peer table holds `get_peer_array` (nvshmem_ptr) of every peer's heap:
the load/store addresses p2p kernels use, which exist only for PEs NVLink or
PCIe can reach (one host); across hosts the table is refused and only
nvshmem-transport kernels run. Modules linked against libnvshmem_device are
registered with nvshmemx_cumodule_init when loaded and finalized before NVSHMEM.

NVSHMEM is initialized once per process, by the first World, and finalized
when the process exits (or at once when a World could not be made):
finalizing and initializing again for every World left 1.1 MiB of device
memory behind per cycle (measured: +110 MiB over 100 cycles on 4 H200s), and
NVSHMEM keeps its bootstrap across a re-init anyway. A World frees its heaps
and its modules' registrations when it closes.

Teardown is collective (nvshmem_free and nvshmem_finalize are barriers over
every PE) and nvshmem4py holds the GIL inside them, so no Python-level
deadline can end a wait for a PE that never comes. Every rank therefore
meets the others in the store first (its server is another process, or torch's
C++ thread, so it answers whatever the ranks are blocked in) and enters the NVSHMEM call only
when all have arrived; when the store says a rank aborted, or the meeting
times out, the call is skipped and the memory left to the process's exit.
After a kernel trap the CUDA context is lost and nothing is touched.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
from typing import Any, Callable, Mapping, NamedTuple

from ..errors import CUDA_EXTRAS_HINT, RuntimeSetupError
from . import store as store_mod
from .ipc import context_lost, join, launcher_world, pick_device

# NVSHMEM reserves its symmetric heap at init; tsgen's heaps hold a module's
# buffers for one count (a 1 GiB allgather at 4 ranks needs 1.25 GiB). Users
# who run larger set it themselves.
DEFAULT_SYMMETRIC_SIZE = "8G"


class NvshmemLib(NamedTuple):
    core: Any  # nvshmem.core
    bindings: Any  # nvshmem.bindings
    Device: Any  # cuda.core.Device


def import_nvshmem() -> NvshmemLib:
    """nvshmem4py's modules, or a message that says what to install."""
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
        from cuda.core import Device
    except ImportError as e:
        raise RuntimeSetupError(
            f"the nvshmem backend needs nvshmem4py and the NVSHMEM library: {CUDA_EXTRAS_HINT}, which brings "
            f"nvshmem4py-cu13 and nvidia-nvshmem-cu13 ({e})"
        ) from None
    return NvshmemLib(core, bindings, Device)


class _Session:
    """NVSHMEM in this process: who it was initialized as, and whether it still is."""

    def __init__(self, lib: NvshmemLib, cp, store, rank: int, size: int, device: int):
        self.lib, self.cp, self.store = lib, cp, store
        self.rank, self.size, self.device = rank, size, device
        self.live = True

    @property
    def where(self) -> str:
        return f"rank {self.rank} (GPU {self.device})"

    def collective(self, fn: Callable[[], None], what: str) -> bool:
        """Meet every rank in the store, then run the NVSHMEM collective `fn`; False (with a
        message, and NVSHMEM given up for this process) when a rank aborted or never came."""
        if not self.live:
            return False
        if _context_lost(self.cp, self.device, self.where):
            self.live = False
            return False
        try:
            # A rank that has seen an abort does not announce itself; one that has announced
            # enters as soon as every rank has (the store's wait checks arrivals before aborts).
            # So either every rank enters, or the ones that announced give up on the abort.
            aborted = self.store.aborted()
            if aborted is not None:
                raise store_mod.StoreError(aborted)
            self.store.barrier(f"NVSHMEM: {what}")
        except store_mod.StoreError as e:
            print(f"tsgen: {self.where}: {what} skipped ({e}); NVSHMEM is left to the process's exit",
                  file=sys.stderr)
            self.live = False
            return False
        try:
            with self.cp.cuda.Device(self.device):
                fn()
        except Exception as e:
            raise RuntimeSetupError(f"{self.where}: {what}: {e}") from None
        return True

    def finalize(self) -> None:
        """nvshmem_finalize (collective), once; registered to run at exit."""
        if self.live:
            try:
                self.collective(self.lib.core.finalize, "nvshmem_finalize")
            except RuntimeSetupError as e:
                print(f"tsgen: {e}", file=sys.stderr)
        self.live = False
        if _SESSIONS.get(id(self.lib.core)) is self:
            del _SESSIONS[id(self.lib.core)]


_SESSIONS: dict[int, _Session] = {}  # by id(nvshmem.core): one in a real process


def _context_lost(cp, device: int, where: str) -> bool:
    return context_lost(cp, device, where, "NVSHMEM to the process's exit")


class NvshmemBackend:
    """This process's PE of a world of one process per GPU (see the module doc)."""

    nvshmem = True  # runs modules built for the nvshmem transport (see world.device_lib_refusal)

    def __init__(self, cp, size: int | None = None, env: Mapping[str, str] | None = None,
                 rendezvous: store_mod.Rendezvous | None = None, lib: NvshmemLib | None = None):
        env = os.environ if env is None else env
        info = launcher_world(env, size)
        self.cp, self.rank, self.size = cp, info.rank, info.size
        self.lib = lib or import_nvshmem()
        self.core, self.bindings = self.lib.core, self.lib.bindings
        rt = cp.cuda.runtime
        self.device = pick_device(info.local_rank, rt.getDeviceCount(), env, guessed=info.local_guessed)
        self.devices = {self.rank: self.device}
        self.store = rendezvous or store_mod.shared(info.master_addr, info.master_port, info.rank, info.size)
        self._heaps: dict[int, Any] = {}  # own base -> the nvshmem array holding it
        self._modules: list[int] = []  # CUmodule handles registered with nvshmemx_cumodule_init
        self._session: _Session | None = None
        try:
            members = join(self.store, self.rank, self.size, rt.deviceGetPCIBusId(self.device), one_host=False)
            hosts = sorted({m["host"] for m in members})
            # p2p kernels (peer loads and stores) need every rank on this host; nvshmem ones do not
            self.mesh_problem = None if len(hosts) == 1 else (
                f"the ranks run on {len(hosts)} hosts ({', '.join(hosts)}): kernels that load and store peer "
                "memory need one host; build the spec with params.transport: nvshmem to run across hosts")
            self.bus_ids = [m["bus"] for m in members]
            self._init(env)
        except Exception as e:
            self.store.abort(f"joining the world: {e}")
            if self._session is not None and self._session is _SESSIONS.get(id(self.core)):
                self._session.finalize()  # init got that far: undo it now (the store is aborted: skipped)
            self._session = None
            raise

    def _where(self) -> str:
        return f"rank {self.rank} (GPU {self.device})"

    def _init(self, env: Mapping[str, str]) -> None:
        """This process's NVSHMEM session: made by the first World (unique id from rank 0
        over the store, nvshmem init with PE = rank), reused by the later ones."""
        core, bindings = self.core, self.bindings
        session = _SESSIONS.get(id(core))
        if session is not None and session.live:
            if (session.rank, session.size, session.device) != (self.rank, self.size, self.device):
                raise RuntimeSetupError(
                    f"{self._where()}: NVSHMEM is already initialized in this process as PE {session.rank} of "
                    f"{session.size} on GPU {session.device}; one process is one PE for its lifetime")
            self._session = session
            return
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", env.get("NVSHMEM_SYMMETRIC_SIZE", DEFAULT_SYMMETRIC_SIZE))
        uid = core.get_unique_id(empty=self.rank != 0)
        nbytes = uid._data.itemsize
        mine = ctypes.string_at(uid.ptr, nbytes) if self.rank == 0 else b""
        got = self.store.all_gather("NVSHMEM unique id from rank 0", mine)[0]
        if len(got) != nbytes:
            raise RuntimeSetupError(f"{self._where()}: NVSHMEM unique id from rank 0 has {len(got)} bytes, this "
                                    f"NVSHMEM expects {nbytes}: the ranks load different NVSHMEM versions")
        ctypes.memmove(uid.ptr, got, nbytes)
        device = self.lib.Device(self.device)
        device.set_current()
        try:
            core.init(device=device, uid=uid, rank=self.rank, nranks=self.size, initializer_method="uid")
        except Exception as e:
            raise RuntimeSetupError(f"{self._where()}: NVSHMEM init (unique id over the store) failed: {e}") from None
        self._session = _SESSIONS[id(core)] = _Session(self.lib, self.cp, self.store, self.rank, self.size,
                                                       self.device)
        # at exit, before the store goes (atexit runs the last registered first)
        atexit.register(self._session.finalize)
        pe, npes = bindings.my_pe(), bindings.n_pes()
        if (pe, npes) != (self.rank, self.size):
            raise RuntimeSetupError(f"{self._where()}: NVSHMEM made this process PE {pe} of {npes}, not "
                                    f"{self.rank} of {self.size}")

    # -- heaps ---------------------------------------------------------------

    def alloc_heap(self, nbytes: int) -> dict[int, int]:
        """nvshmem_malloc on every PE (collective): the same offset everywhere."""
        with self.cp.cuda.Device(self.device):
            try:
                heap = self.core.array((nbytes,), dtype="uint8")
            except Exception as e:
                raise RuntimeSetupError(
                    f"{self._where()}: nvshmem_malloc of a {nbytes}-byte symmetric heap failed ({e}); the "
                    f"symmetric heap is NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE')}") from None
        base = int(heap.data.ptr)
        self._heaps[base] = heap
        return {self.rank: base}

    def peer_tables(self, bases: dict[int, int]) -> dict[int, Any]:
        """Every PE's heap as this PE can load and store it (nvshmem_ptr); 0 where it cannot."""
        cp = self.cp
        base = bases[self.rank]
        heap = self._heaps[base]
        with cp.cuda.Device(self.device):
            ptrs = []
            for r in range(self.size):
                if r == self.rank:
                    ptrs.append(base)
                    continue
                try:
                    ptrs.append(int(self.core.get_peer_array(heap, r).data.ptr))
                except Exception:  # not reachable by loads and stores (another host)
                    ptrs.append(0)
            return {self.rank: cp.asarray(ptrs, dtype=cp.uint64)}

    def free_heap(self, bases: dict[int, int]) -> None:
        """nvshmem_free (collective) after this GPU's work is done."""
        heap = self._heaps.pop(bases[self.rank], None)
        if heap is None or self._session is None:
            return
        self._session.collective(lambda: self.core.free_array(heap), f"freeing a heap of {heap.nbytes} bytes")

    # -- modules -------------------------------------------------------------

    def register_module(self, handle: int) -> None:
        """nvshmemx_cumodule_init on a loaded module linked against libnvshmem_device."""
        with self.cp.cuda.Device(self.device):
            status = self.bindings.cumodule_init(int(handle))
        if status not in (None, 0):
            raise RuntimeSetupError(f"{self._where()}: nvshmemx_cumodule_init failed ({status})")
        self._modules.append(int(handle))

    def unregister_module(self, handle: int) -> None:
        if int(handle) in self._modules:
            self._modules.remove(int(handle))
            if self._live():
                with self.cp.cuda.Device(self.device):
                    self.bindings.cumodule_finalize(int(handle))

    # -- teardown ------------------------------------------------------------

    def _live(self) -> bool:
        """NVSHMEM is up and this GPU's context works (else nothing may touch either)."""
        if self._session is None or not self._session.live:
            return False
        if _context_lost(self.cp, self.device, self._where()):
            self._session.live = False  # never finalized: the process's exit cleans up
            return False
        return True

    def close(self) -> None:
        """Free this World's heaps and module registrations (NVSHMEM stays up for the next
        World and is finalized at exit); raise afterwards if a heap could not be freed."""
        problems = []
        for base in list(self._heaps):
            try:
                self.free_heap({self.rank: base})
            except RuntimeSetupError as e:
                problems.append(str(e))
        self._heaps.clear()
        for handle in list(self._modules):
            self.unregister_module(handle)
        if problems:
            raise RuntimeSetupError("; ".join(problems))

    def finalize(self) -> None:
        """Finalize this process's NVSHMEM now rather than at exit (collective: every rank
        calls it); no World can be made on this backend's PE afterwards."""
        self.close()
        if self._session is not None:
            self._session.finalize()
