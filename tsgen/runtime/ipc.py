"""One process per GPU: symmetric heaps shared through CUDA IPC handles.

Each process drives one rank. Who it is comes from torch.distributed's default
process group when the process has one, else from the launcher's environment
(`process_env`: torchrun / tsgen launch, mpirun, MPI with PMI, Slurm); the ranks
meet through a store (tsgen.runtime.store picks it: the process group's, torchrun's
or tsgen's own). A heap is one
cudaMalloc per rank (outside CuPy's pool, so its IPC handle names exactly
that allocation and the offset is 0); its handle goes through the store, and
every rank opens every peer's handle, which gives this rank's peer table:
each rank's heap base as mapped in this process. Freeing closes the peer
mappings, waits until every rank has closed them, then frees the own heap.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import RuntimeSetupError
from . import store as store_mod
from .store import StoreError

# (launcher, rank variable, size variable, local-rank variable), first match wins:
# torchrun inside an mpirun or Slurm job is still torchrun.
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
DEFAULT_PORT = 29500  # torch's default MASTER_PORT


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    size_var: str  # the variable `size` came from, for messages
    local_guessed: bool = False  # no launcher variable gave the local rank: it is the group's rank


def _int_var(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise RuntimeSetupError(f"{name}={text!r} is not a whole number") from None


def _master(env: Mapping[str, str]) -> tuple[str, int]:
    """Where the store is reached or served: MASTER_ADDR / MASTER_PORT (default 127.0.0.1:29500)."""
    port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
    if not 0 < port < 65536:
        raise RuntimeSetupError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return env.get("MASTER_ADDR") or "127.0.0.1", port


def _launched(env: Mapping[str, str]) -> ProcessInfo | None:
    """What the first launcher of LAUNCHERS whose variables are set says, or None."""
    for launcher, rank_var, size_var, local_var in LAUNCHERS:
        if rank_var not in env and size_var not in env:
            continue
        for have, need in ((rank_var, size_var), (size_var, rank_var)):
            if have in env and need not in env:
                raise RuntimeSetupError(f"{have}={env[have]} is set but {need} is not ({launcher} sets both)")
        rank, size = _int_var(env, rank_var), _int_var(env, size_var)
        if size < 1:
            raise RuntimeSetupError(f"{size_var}={size}: a world has at least 1 rank")
        if not 0 <= rank < size:
            raise RuntimeSetupError(f"{rank_var}={rank} but {size_var}={size}: ranks run from 0 to {size - 1}")
        local_rank = _int_var(env, local_var) if local_var in env else rank
        if local_rank < 0:
            raise RuntimeSetupError(f"{local_var}={local_rank} is negative")
        return ProcessInfo(rank, size, local_rank, *_master(env), launcher, size_var)
    return None


TORCH_GROUP = "torch.distributed"


def process_env(env: Mapping[str, str], group: tuple[int, int] | None = None) -> ProcessInfo:
    """This process's rank, world size and local rank: torch.distributed's default process group's
    (`group`: its rank and size, when one is initialized; the local rank from the launcher, else
    the rank), else from the variables a launcher sets; the store's address from MASTER_ADDR /
    MASTER_PORT (default 127.0.0.1:29500). Pure: raises RuntimeSetupError naming the variables
    when they are missing or wrong, or disagree with the process group."""
    launched = _launched(env)
    if group is not None:
        rank, size = group
        if launched is not None and (launched.rank, launched.size) != (rank, size):
            raise RuntimeSetupError(
                f"torch.distributed's default process group makes this process rank {rank} of {size}, but "
                f"{launched.launcher}'s variables say rank {launched.rank} of {launched.size} "
                f"({launched.size_var}={launched.size}): tsgen runs on the process group's ranks; initialize "
                "it with the launcher's rank and world size (init_method='env://')")
        local_rank = launched.local_rank if launched is not None else rank
        return ProcessInfo(rank, size, local_rank, *_master(env), TORCH_GROUP,
                           "torch.distributed.get_world_size()", local_guessed=launched is None)
    if launched is not None:
        return launched
    names = ", ".join(f"{r}/{s} ({launcher})" for launcher, r, s, _ in LAUNCHERS)
    raise RuntimeSetupError(
        f"the ipc and nvshmem backends run one process per GPU, but no launcher set this process's rank: none of {names} "
        "is set, and torch.distributed has no process group. Start the ranks with torchrun, `tsgen launch --nproc N "
        "-- ...`, mpirun or srun, or initialize a torch.distributed process group first"
    )


def launcher_world(env: Mapping[str, str], size: int | None = None) -> ProcessInfo:
    """`process_env` (with torch.distributed's default process group when this process has one),
    checking the world size asked for (None: any) against the launcher's."""
    info = process_env(env, store_mod.torch_group())
    if size is not None and size != info.size:
        raise RuntimeSetupError(f"world size {size} asked for (--gpus), but the launcher started {info.size} "
                                f"ranks ({info.size_var}={info.size})")
    return info


def pick_device(local_rank: int, visible: int, env: Mapping[str, str] | None = None, share: bool = False,
                guessed: bool = False) -> int:
    """The GPU of a process with this local rank that sees `visible` GPUs: the only one
    when the launcher bound one GPU per process, else GPU `local_rank` (`share`: GPU
    local_rank % visible). `guessed`: no launcher variable gave the local rank (a process
    group made by hand): it is the group's rank, right on one host only, and the error says so.
    Pure."""
    if visible == 1:
        return 0
    if local_rank < visible or share:
        return local_rank % visible
    env = os.environ if env is None else env
    shown = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in env else ""
    if guessed:
        raise RuntimeSetupError(
            f"torch.distributed rank {local_rank} has no local rank (no LOCAL_RANK or other launcher variable is "
            f"set), so tsgen took the rank as this host's GPU index, but this process sees {visible} GPUs{shown}: "
            "set LOCAL_RANK to the GPU index of this process on its host (torchrun sets it), or bind one GPU per "
            "process with CUDA_VISIBLE_DEVICES")
    raise RuntimeSetupError(
        f"local rank {local_rank} needs GPU {local_rank}, but this process sees {visible} GPUs{shown}: "
        f"start at most {visible} ranks on this host"
    )


MPS_HINT = ("processes that share a GPU without MPS are time-sliced, so their kernels are never resident "
            "together and ranks that wait on each other can deadlock. Either start the MPS daemon "
            "(`nvidia-cuda-mps-control -d`; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/N gives each of N ranks "
            "its share of the SMs) and pass --share-gpus, or test in one process: "
            "`tsgen test SPEC --gpus N --share-gpus`")


def join_problem(members: list[dict], size: int, one_host: bool = True, share: bool = False,
                 mps: bool = False) -> str | None:
    """What is wrong with the ranks that met (each: rank, size, host, bus id), or None.
    `one_host`: CUDA IPC needs every rank on one host (NVSHMEM does not). Ranks may share a
    GPU only when asked (`share`) and under MPS (`mps`). Pure."""
    for m in members:
        if m["size"] != size:
            return (f"rank {m['rank']} was started in a world of {m['size']} ranks, rank 0 in one of "
                    f"{members[0]['size']}: the launcher's world sizes disagree")
    hosts = sorted({m["host"] for m in members})
    if one_host and len(hosts) > 1:
        where = "; ".join(f"{h}: ranks {', '.join(str(m['rank']) for m in members if m['host'] == h)}" for h in hosts)
        return (f"CUDA IPC needs every rank on one host, but the ranks run on {len(hosts)} hosts ({where}); "
                "use one host, or the NVSHMEM backend across hosts")
    seen: dict[tuple[str, str], int] = {}
    for m in members:
        gpu = (m["host"], m["bus"])
        if gpu in seen and not (share and mps):
            where = f"ranks {seen[gpu]} and {m['rank']} both run on GPU {m['bus']} of {m['host']}"
            if share:
                return f"{where}, and no MPS daemon runs: {MPS_HINT}"
            return (f"{where}: give each rank its own GPU (LOCAL_RANK, or CUDA_VISIBLE_DEVICES per rank), "
                    f"or let them share it with --share-gpus under MPS ({MPS_HINT})")
        seen[gpu] = m["rank"]
    return None


def join(store: store_mod.Rendezvous, rank: int, size: int, bus: str, one_host: bool = True,
         share: bool = False) -> list[dict]:
    """Every rank's host and GPU (PCI bus id), in rank order, checked by `join_problem`."""
    from .placement import mps_active

    me = {"rank": rank, "size": size, "host": socket.gethostname(), "bus": bus}
    members = [json.loads(m) for m in store.all_gather("join: host and GPU of every rank", json.dumps(me).encode())]
    problem = join_problem(members, size, one_host, share=share, mps=mps_active())
    if problem:
        raise RuntimeSetupError(problem)
    return members


def context_lost(cp, device: int, where: str, leaving: str) -> bool:
    """True (with a message) when `device`'s CUDA context is gone: after a kernel trap
    nothing may be freed or waited for; `leaving` says what is left to the driver."""
    rt = cp.cuda.runtime
    with cp.cuda.Device(device):
        try:
            rt.deviceSynchronize()
            return False
        except rt.CUDARuntimeError as e:
            print(f"tsgen: {where}: CUDA context lost ({e}); leaving {leaving}", file=sys.stderr)
            return True


@dataclass
class _Heap:
    id: int  # the same on every rank: ranks allocate heaps in the same order
    nbytes: int
    opened: dict[int, int] = field(default_factory=dict)  # peer rank -> its heap mapped here


class IpcBackend:
    """This process's rank of a world of one process per GPU (see the module doc)."""

    def __init__(self, cp, size: int | None = None, env: Mapping[str, str] | None = None,
                 rendezvous: store_mod.Rendezvous | None = None, share_gpus: bool = False):
        env = os.environ if env is None else env
        info = launcher_world(env, size)
        self.cp, self.rank, self.size = cp, info.rank, info.size
        rt = cp.cuda.runtime
        self.device = pick_device(info.local_rank, rt.getDeviceCount(), env, share=share_gpus,
                                  guessed=info.local_guessed)
        self.devices = {self.rank: self.device}
        self.store = rendezvous or store_mod.shared(info.master_addr, info.master_port, info.rank, info.size)
        self._heaps: dict[int, _Heap] = {}  # by own base address
        self._next_id = 0
        try:
            members = join(self.store, self.rank, self.size, rt.deviceGetPCIBusId(self.device), share=share_gpus)
            self.bus_ids = [m["bus"] for m in members]
            self._check_peer_access()
        except Exception as e:
            self.store.abort(f"joining the world: {e}")
            raise

    def _where(self) -> str:
        return f"rank {self.rank} (GPU {self.device})"

    def _check_peer_access(self) -> None:
        """cudaDeviceCanAccessPeer for every peer GPU this process can see (a launcher that
        binds one GPU per process hides them: then opening the handles is the test)."""
        rt = self.cp.cuda.runtime
        for r, bus in enumerate(self.bus_ids):
            if r == self.rank:
                continue
            try:
                peer = rt.deviceGetByPCIBusId(bus)
            except rt.CUDARuntimeError:
                continue
            if peer != self.device and not rt.deviceCanAccessPeer(self.device, peer):
                raise RuntimeSetupError(
                    f"{self._where()} cannot access rank {r}'s GPU {bus} directly (no peer access); tsgen's p2p "
                    "kernels need every pair connected (NVLink or PCIe P2P)")

    def alloc_heap(self, nbytes: int) -> dict[int, int]:
        rt = self.cp.cuda.runtime
        with self.cp.cuda.Device(self.device):
            try:
                base = rt.malloc(nbytes)  # outside CuPy's pool: the IPC handle names exactly this allocation
            except rt.CUDARuntimeError as e:
                raise RuntimeSetupError(f"{self._where()}: allocating a {nbytes}-byte symmetric heap: {e}") from None
        self._heaps[base] = _Heap(self._next_id, nbytes)
        self._next_id += 1
        return {self.rank: base}

    def peer_tables(self, bases: dict[int, int]) -> dict[int, Any]:
        """Publish this rank's heap handle, open every peer's: {rank: device table of all bases}."""
        cp, rt = self.cp, self.cp.cuda.runtime
        base = bases[self.rank]
        heap = self._heaps[base]
        with cp.cuda.Device(self.device):
            mine = struct.pack("!Q", heap.nbytes) + rt.ipcGetMemHandle(base)
            got = self.store.all_gather(f"heap {heap.id}: CUDA IPC handles", mine)
            try:
                ptrs = []
                for r, payload in enumerate(got):
                    if r == self.rank:
                        ptrs.append(base)
                        continue
                    (nbytes,) = struct.unpack("!Q", payload[:8])
                    if nbytes != heap.nbytes:
                        raise RuntimeSetupError(
                            f"heap {heap.id}: rank {r}'s is {nbytes} bytes, rank {self.rank}'s {heap.nbytes}: the "
                            "ranks allocated different buffers (another module or count?)")
                    try:
                        heap.opened[r] = rt.ipcOpenMemHandle(payload[8:])
                    except rt.CUDARuntimeError as e:
                        raise RuntimeSetupError(
                            f"{self._where()}: cudaIpcOpenMemHandle of rank {r}'s heap {heap.id} (GPU "
                            f"{self.bus_ids[r]}) failed: {e}") from None
                    ptrs.append(heap.opened[r])
                return {self.rank: cp.asarray(ptrs, dtype=cp.uint64)}
            except BaseException:
                self._close_mappings(heap)
                raise

    def _close_mappings(self, heap: _Heap) -> list[str]:
        rt = self.cp.cuda.runtime
        problems = []
        for r, ptr in sorted(heap.opened.items()):
            try:
                rt.ipcCloseMemHandle(ptr)
            except rt.CUDARuntimeError as e:
                problems.append(f"closing rank {r}'s heap {heap.id}: {e}")
        heap.opened.clear()
        return problems

    def free_heap(self, bases: dict[int, int]) -> None:
        """Close the peer mappings, wait until every rank has, free the own heap. Once a
        rank has aborted the ranks are out of step: free without waiting (a peer that
        still maps the heap keeps it alive until it closes its mapping or exits). After
        a kernel failed the CUDA context is gone: nothing can be freed, the driver
        reclaims the memory when the process exits."""
        rt = self.cp.cuda.runtime
        heap = self._heaps.pop(bases[self.rank], None)
        if heap is None:
            return
        # nothing of ours may still use the heap; fails if the context is lost
        if context_lost(self.cp, self.device, self._where(), f"heap {heap.id} to the driver"):
            return
        with self.cp.cuda.Device(self.device):
            problems = self._close_mappings(heap)
            try:
                self.store.barrier(f"heap {heap.id}: every rank closed its mappings")
            except StoreError as e:
                if self.store.aborted() is None:  # else a peer failed and says why itself
                    problems.append(str(e))
            try:
                rt.free(bases[self.rank])
            except rt.CUDARuntimeError as e:
                problems.append(f"freeing heap {heap.id}: {e}")
        if problems:
            raise RuntimeSetupError(f"{self._where()}: " + "; ".join(problems))

    def close(self) -> None:
        """Free what is left (every rank frees its heaps in the order they were made)."""
        problems = []
        for base, heap in sorted(self._heaps.items(), key=lambda kv: kv[1].id):
            try:
                self.free_heap({self.rank: base})
            except RuntimeSetupError as e:
                problems.append(str(e))
        if problems:
            raise RuntimeSetupError("; ".join(problems))
