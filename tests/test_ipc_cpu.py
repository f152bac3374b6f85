"""One process per GPU, on CPU: the launcher environment, device choice, the checks
made when the ranks meet, and the IPC backend's handle exchange and teardown
against a fake CUDA runtime (threads stand for processes, the store is real)."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from conftest import close_ranks, localhost_ranks, together
from tsgen.errors import RuntimeSetupError
from tsgen.runtime.backends import world_size
from tsgen.runtime.ipc import IpcBackend, join_problem, pick_device, process_env
from tsgen.runtime.store import StoreError

# ---------------------------------------------------------------------------
# environment -> rank, world size, local rank
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("env,want", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"},
     (3, 4, 1, "node7", 1234, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
     (2, 8, 2, "127.0.0.1", 29500, "mpirun (Open MPI)")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, (1, 2, 0, "127.0.0.1", 29500, "MPI (PMI)")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_PORT": "4000"},
     (5, 8, 1, "127.0.0.1", 4000, "Slurm")),
    # no local rank: one host assumed, local rank = rank
    ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2, 1, "127.0.0.1", 29500, "torchrun")),
    # torchrun inside an mpirun / Slurm job wins over the outer launcher
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
      "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, (0, 2, 0, "127.0.0.1", 29500, "torchrun")),
    # mpirun inside a Slurm allocation
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
     (1, 2, 1, "127.0.0.1", 29500, "mpirun (Open MPI)")),
], ids=["torchrun", "openmpi", "pmi", "slurm", "no-local-rank", "torchrun-first", "mpirun-over-slurm"])
def test_process_env(env, want):
    i = process_env(env)
    assert (i.rank, i.size, i.local_rank, i.master_addr, i.master_port, i.launcher) == want


def test_process_env_nothing_set_names_every_variable():
    with pytest.raises(RuntimeSetupError) as e:
        process_env({"PATH": "/bin"})
    msg = str(e.value)
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                "SLURM_PROCID", "SLURM_NTASKS", "tsgen launch --nproc N"):
        assert var in msg, var
    assert e.value.exit_code == 2


@pytest.mark.parametrize("env,message", [
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not (torchrun sets both)"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4 is set but OMPI_COMM_WORLD_RANK is not"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not a whole number"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 but WORLD_SIZE=4: ranks run from 0 to 3"),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, "RANK=-1 but WORLD_SIZE=4: ranks run from 0 to 3"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0: a world has at least 1 rank"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": ""}, "MASTER_PORT='' is not a whole number"),
])
def test_process_env_errors(env, message):
    with pytest.raises(RuntimeSetupError) as e:
        process_env(env)
    assert str(e.value).startswith(message), str(e.value)


def test_process_env_from_a_torch_process_group():
    """A process of an initialized torch.distributed group: the group's rank and size, the launcher's
    local rank (else the rank), MASTER_ADDR / MASTER_PORT as ever; a launcher that disagrees is refused."""
    i = process_env({}, group=(2, 4))
    assert (i.rank, i.size, i.local_rank, i.master_addr, i.master_port, i.launcher) == (
        2, 4, 2, "127.0.0.1", 29500, "torch.distributed")
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"}
    i = process_env(env, group=(3, 4))
    assert (i.rank, i.size, i.local_rank, i.master_addr, i.master_port, i.launcher) == (
        3, 4, 1, "node7", 1234, "torch.distributed")
    with pytest.raises(RuntimeSetupError, match=r"torch.distributed's default process group makes this process "
                                                r"rank 0 of 2, but torchrun's variables say rank 3 of 4 "
                                                r"\(WORLD_SIZE=4\)"):
        process_env(env, group=(0, 2))


def test_world_size_per_backend():
    env = {"RANK": "0", "WORLD_SIZE": "2"}
    assert world_size("single", 3, env) == 3
    assert world_size("ipc", None, env) == 2
    assert world_size("ipc", 2, env) == 2
    with pytest.raises(RuntimeSetupError, match=r"world size 3 asked for \(--gpus\), but the launcher started 2 "
                                                r"ranks \(WORLD_SIZE=2\)"):
        world_size("ipc", 3, env)
    with pytest.raises(RuntimeSetupError, match="give --gpus N"):
        world_size("single", None, env)
    assert world_size("nvshmem", None, env) == 2  # one process per GPU too
    with pytest.raises(RuntimeSetupError, match="backend 'shmem': choose one of single, ipc, nvshmem"):
        world_size("shmem", 2, env)


def test_pick_device():
    assert pick_device(3, 4) == 3
    # a process group made by hand on a second host: rank 9 is no GPU index here, and the error says why
    with pytest.raises(RuntimeSetupError, match="rank 9 has no local rank .* set LOCAL_RANK"):
        pick_device(9, 8, {}, guessed=True)
    assert process_env({}, group=(9, 16)).local_guessed
    assert not process_env({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}, group=(9, 16)).local_guessed
    assert pick_device(3, 1) == 0  # the launcher bound one GPU to this process
    assert pick_device(0, 8) == 0
    with pytest.raises(RuntimeSetupError) as e:
        pick_device(4, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert str(e.value) == ("local rank 4 needs GPU 4, but this process sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1): "
                            "start at most 2 ranks on this host")


def _member(rank, size=3, host="a", bus=None):
    return {"rank": rank, "size": size, "host": host, "bus": bus or f"0000:{rank:02x}:00.0"}


def test_join_problem():
    assert join_problem([_member(r) for r in range(3)], 3) is None
    assert join_problem([_member(0), _member(1, size=4), _member(2)], 3) == (
        "rank 1 was started in a world of 4 ranks, rank 0 in one of 3: the launcher's world sizes disagree")
    assert join_problem([_member(0), _member(1, host="b"), _member(2, host="b")], 3) == (
        "CUDA IPC needs every rank on one host, but the ranks run on 2 hosts (a: ranks 0; b: ranks 1, 2); "
        "use one host, or the NVSHMEM backend across hosts")
    same_gpu = [_member(0), _member(1), _member(2, bus="0000:00:00.0")]
    assert join_problem(same_gpu, 3).startswith(
        "ranks 0 and 2 both run on GPU 0000:00:00.0 of a: give each rank its own GPU (LOCAL_RANK, or "
        "CUDA_VISIBLE_DEVICES per rank), or let them share it with --share-gpus under MPS (")
    # asked to share: only under MPS (processes are time-sliced without it), and the message says so
    assert "no MPS daemon runs" in join_problem(same_gpu, 3, share=True, mps=False)
    assert "nvidia-cuda-mps-control -d" in join_problem(same_gpu, 3, share=True, mps=False)
    assert join_problem(same_gpu, 3, share=True, mps=True) is None
    # NVSHMEM spans hosts: the same bus id on two hosts is two GPUs
    assert join_problem([_member(0, size=2), _member(1, size=2, host="b", bus="0000:00:00.0")], 2,
                        one_host=False) is None


# ---------------------------------------------------------------------------
# The IPC backend against a fake CUDA runtime
# ---------------------------------------------------------------------------


class FakeError(Exception):
    pass


class Machine:
    """GPU memory of one host, shared by the fake processes: allocations, IPC handles
    and mappings, with the rules that matter (a handle is opened in another process;
    nothing may be freed while a peer still maps it)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.next = 0x10000
        self.allocs: dict[int, dict] = {}  # base -> {gpu, nbytes, maps}
        self.mappings: dict[int, int] = {}  # mapped address -> base
        self.violations: list[str] = []
        self.fail_open: set[tuple[int, int]] = set()  # (importing gpu, exporting gpu)
        self.fail_after = 0  # a failing open waits (10 s at most) until this many mappings are open
        self.opened = threading.Condition(self.lock)
        self.dead: set[int] = set()  # GPUs whose context is lost

    def runtime(self, gpus: list[int]):
        return FakeRuntime(self, gpus)


class FakeRuntime:
    CUDARuntimeError = FakeError

    def __init__(self, machine: Machine, gpus: list[int]):
        self.m, self.gpus, self._local = machine, gpus, threading.local()

    @property
    def current(self):  # per thread, like CUDA's current device
        return getattr(self._local, "current", 0)

    @current.setter
    def current(self, d):
        self._local.current = d

    def _gpu(self):
        return self.gpus[self.current]

    def memset(self, ptr, value, nbytes):
        base = max((b for b in self.m.allocs if b <= ptr), default=None)
        assert base is not None and ptr + nbytes <= base + self.m.allocs[base]["nbytes"], "memset outside a heap"

    def getDeviceCount(self):
        return len(self.gpus)

    def deviceGetPCIBusId(self, d):
        return f"0000:{self.gpus[d]:02x}:00.0"

    def deviceGetByPCIBusId(self, bus):
        gpu = int(bus.split(":")[1], 16)
        if gpu not in self.gpus:
            raise FakeError("cudaErrorInvalidDevice")
        return self.gpus.index(gpu)

    def deviceCanAccessPeer(self, a, b):
        return 1

    def deviceSynchronize(self):
        if self._gpu() in self.m.dead:
            raise FakeError("cudaErrorLaunchFailure: unspecified launch failure")

    def malloc(self, n):
        with self.m.lock:
            base, self.m.next = self.m.next, self.m.next + max(n, 1) + 0x1000
            self.m.allocs[base] = {"gpu": self._gpu(), "nbytes": n, "maps": 0}
        return base

    def free(self, ptr):
        with self.m.lock:
            a = self.m.allocs[ptr]
            assert not a.get("freed"), "freed twice"
            if a["maps"]:  # the memory lives on until the last mapping is closed
                self.m.violations.append(f"heap {ptr:#x} freed while {a['maps']} peer(s) still map it")
                a["freed"] = True
            else:
                del self.m.allocs[ptr]

    def ipcGetMemHandle(self, ptr):
        assert ptr in self.m.allocs, "handle of something that is not an allocation base"
        return ptr.to_bytes(8, "little") + bytes(56)

    def ipcOpenMemHandle(self, handle):
        base = int.from_bytes(handle[:8], "little")
        with self.m.lock:
            a = self.m.allocs[base]
            if a["gpu"] == self._gpu():
                raise FakeError("cudaErrorInvalidContext: a handle cannot be opened in the process that made it")
            if (self._gpu(), a["gpu"]) in self.m.fail_open:
                self.m.opened.wait_for(lambda: len(self.m.mappings) >= self.m.fail_after, timeout=10)
                raise FakeError("cudaErrorMapBufferObjectFailed: mapping of buffer object failed")
            mapped, self.m.next = self.m.next, self.m.next + a["nbytes"] + 0x1000
            self.m.mappings[mapped] = base
            a["maps"] += 1
            self.m.opened.notify_all()
        return mapped

    def ipcCloseMemHandle(self, ptr):
        with self.m.lock:
            base = self.m.mappings.pop(ptr)
            a = self.m.allocs[base]
            a["maps"] -= 1
            if a.get("freed") and not a["maps"]:
                del self.m.allocs[base]


def fake_cupy(machine: Machine, gpus: list[int]):
    rt = machine.runtime(gpus)

    class Cuda:
        runtime = rt

        @staticmethod
        @contextlib.contextmanager
        def Device(i):
            old, rt.current = rt.current, i
            try:
                yield
            finally:
                rt.current = old

        class Stream:  # World makes one non-blocking stream per rank
            def __init__(self, non_blocking=False):
                self.device = rt.current

    class Table(np.ndarray):  # a "device" array: .get() copies to the host
        def get(self):
            return np.asarray(self).copy()

    class Cp:
        cuda = Cuda
        uint64 = np.uint64

        @staticmethod
        def asarray(values, dtype):
            return np.asarray(values, dtype=dtype).view(Table)

    return Cp


def ipc_world(size, machine=None, timeout=10.0, gpus=None, store="tsgen"):
    """`size` fake processes: each its Rendezvous (on `store`: TSGEN_STORE) and its fake CUDA
    seeing `gpus(rank)`."""
    machine = machine or Machine()
    rvs = localhost_ranks(size, timeout=timeout, store=store)
    see = gpus or (lambda r: list(range(size)))

    def make(r, rv):
        env = {"RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r)}
        return IpcBackend(fake_cupy(machine, see(r)), size, env=env, rendezvous=rv)

    return machine, rvs, together(rvs, make)


def _assert_all_released(machine):
    _assert_all_released_but_for(machine, 0)


def _assert_all_released_but_for(machine, violations: int):
    """Nothing left allocated or mapped; `violations` heaps freed while still mapped
    (only after an abort, when the ranks no longer wait for each other)."""
    assert machine.allocs == {} and machine.mappings == {} and len(machine.violations) == violations


def _every_rank(rvs, run):
    """run(rank, rendezvous) on every rank at once (results or exceptions, in rank order), then
    every rendezvous closed."""
    try:
        return together(rvs, run)
    finally:
        close_ranks(rvs)


def _gives_up(world, label: str) -> tuple[str, float]:
    """A barrier a failed peer never reaches: its error's text and the seconds it waited."""
    t0 = time.monotonic()
    try:
        world.barrier(label)
    except StoreError as e:
        return str(e), time.monotonic() - t0
    raise AssertionError(f"barrier {label!r} completed without the failed rank")


def test_heaps_peer_tables_and_free():
    machine, rvs, backends = ipc_world(4)
    try:
        assert [b.devices for b in backends] == [{r: r} for r in range(4)]
        assert backends[2].bus_ids == [f"0000:{r:02x}:00.0" for r in range(4)]
        bases = together(backends, lambda r, b: b.alloc_heap(4096))
        tables = together(backends, lambda r, b: b.peer_tables(bases[r]))
        for r in range(4):
            assert list(tables[r]) == [r]
            table = tables[r][r]
            for q in range(4):
                addr = int(table[q])
                # own heap as is; every peer's through a mapping of exactly its base
                assert addr == bases[r][r] if q == r else machine.mappings[addr] == bases[q][q]
        assert sum(a["maps"] for a in machine.allocs.values()) == 4 * 3
        assert together(backends, lambda r, b: b.free_heap(bases[r])) == [None] * 4
        _assert_all_released(machine)
    finally:
        close_ranks(rvs)


def test_hundred_create_use_destroy_cycles_release_everything():
    machine, rvs, _ = ipc_world(3)
    try:
        def cycle(r, rv):
            env = {"RANK": str(r), "WORLD_SIZE": "3"}
            for _ in range(100):
                b = IpcBackend(fake_cupy(machine, [0, 1, 2]), 3, env=env, rendezvous=rv)
                heaps = [b.alloc_heap(1000 + 256 * k) for k in range(2)]
                for h in heaps:
                    b.peer_tables(h)
                b.free_heap(heaps[0])
                b.close()  # frees the other
        assert together(rvs, cycle, timeout=120) == [None] * 3
        _assert_all_released(machine)
    finally:
        close_ranks(rvs)


def test_open_failure_names_the_peer_and_closes_what_was_opened():
    machine = Machine()
    machine.fail_open.add((2, 3))  # rank 2 cannot map rank 3's heap
    machine, rvs, backends = ipc_world(4, machine)
    try:
        bases = together(backends, lambda r, b: b.alloc_heap(512))
        got = together(backends, lambda r, b: b.peer_tables(bases[r]))
        assert isinstance(got[2], RuntimeSetupError)
        assert str(got[2]) == ("rank 2 (GPU 2): cudaIpcOpenMemHandle of rank 3's heap 0 (GPU 0000:03:00.0) failed: "
                               "cudaErrorMapBufferObjectFailed: mapping of buffer object failed")
        # rank 2 had opened ranks 0 and 1 before failing: both closed again
        assert sum(a["maps"] for a in machine.allocs.values()) == 3 * 3
        assert together(backends, lambda r, b: b.close()) == [None] * 4
        _assert_all_released(machine)
    finally:
        close_ranks(rvs)


def test_heaps_of_different_sizes_are_refused():
    machine, rvs, backends = ipc_world(3)
    try:
        bases = together(backends, lambda r, b: b.alloc_heap(2048 if r == 1 else 1024))
        got = together(backends, lambda r, b: b.peer_tables(bases[r]))
        assert str(got[0]) == ("heap 0: rank 1's is 2048 bytes, rank 0's 1024: the ranks allocated different "
                               "buffers (another module or count?)")
        assert str(got[1]).startswith("heap 0: rank 0's is 1024 bytes, rank 1's 2048")
        assert together(backends, lambda r, b: b.close()) == [None] * 3
        _assert_all_released(machine)
    finally:
        close_ranks(rvs)


def test_a_peer_that_never_publishes_its_handle():
    machine, rvs, backends = ipc_world(3, timeout=0.5)
    try:
        bases = together(backends, lambda r, b: b.alloc_heap(256))
        got = together(backends[:2], lambda r, b: b.peer_tables(bases[r]))  # rank 2 never gets there
        for r in (0, 1):
            assert isinstance(got[r], StoreError)
            assert str(got[r]).startswith(f"rank {r} waited 0.5 s in 'heap 0: CUDA IPC handles' for rank 2 (key "
                                          "tsgen/0/1/2 in the tsgen store"), got[r]
    finally:
        close_ranks(rvs)


def test_two_ranks_on_one_gpu_are_refused_by_every_rank():
    machine, rvs, got = ipc_world(2, gpus=lambda r: [5])  # a launcher bound the same GPU to both
    try:
        for e in got:
            assert isinstance(e, RuntimeSetupError)
            assert str(e).startswith("ranks 0 and 1 both run on GPU 0000:05:00.0")
        assert "joining the world: ranks 0 and 1 both run" in rvs[0].aborted()
    finally:
        close_ranks(rvs)


def test_lost_context_frees_nothing_and_does_not_wait():
    machine, rvs, backends = ipc_world(2, timeout=30)
    try:
        bases = together(backends, lambda r, b: b.alloc_heap(256))
        together(backends, lambda r, b: b.peer_tables(bases[r]))
        machine.dead.add(0)  # rank 0's kernel trapped
        backends[0].free_heap(bases[0])  # returns at once (no barrier: rank 1 is not there)
        assert bases[0][0] in machine.allocs
    finally:
        close_ranks(rvs)


def test_peer_free_after_abort_still_frees_its_own_heap():
    machine, rvs, backends = ipc_world(2, timeout=30)
    try:
        bases = together(backends, lambda r, b: b.alloc_heap(256))
        together(backends, lambda r, b: b.peer_tables(bases[r]))
        rvs[0].abort("RuntimeSetupError: kernel failed")  # rank 0 failed
        backends[1].free_heap(bases[1])  # no wait, no error of its own: rank 0 reports
        assert machine.allocs[bases[1][1]]["freed"]  # rank 0 still maps it: alive until it closes
        backends[0].free_heap(bases[0])
        _assert_all_released_but_for(machine, 1)
    finally:
        close_ranks(rvs)


def test_world_and_buffers_over_the_ipc_backend(monkeypatch):
    """The real World and Buffers on the IPC backend: per-rank things keyed by this
    process's rank only, every heap freed; an exception inside `with World` tells
    the other processes through the store, so they stop waiting at once."""
    import types

    from conftest import ROOT
    from tsgen.manifest import Manifest
    from tsgen.runtime import world as world_mod

    machine = Machine()
    cp = fake_cupy(machine, [0, 1, 2])
    monkeypatch.setattr(world_mod, "cupy_or_error", lambda: cp)
    manifest = Manifest.load(ROOT / "generated" / "allgather.json")
    rvs = localhost_ranks(3, timeout=30)

    def run(r, rv):
        env = {"RANK": str(r), "WORLD_SIZE": "3"}
        with world_mod.World(3, backend=IpcBackend(cp, 3, env=env, rendezvous=rv)) as world:
            assert (world.size, world.ranks, world.devices, world.is_root) == (3, [r], {r: r}, r == 0)
            assert world.exchange("who", r * 10) == [0, 10, 20]
            bufs = world_mod.Buffers(types.SimpleNamespace(manifest=manifest, world=world), 1000)
            assert list(bufs.bases) == list(bufs.peer_tables) == list(bufs.host_peer_tables) == [r]
            assert int(bufs.host_peer_tables[r][r]) == bufs.bases[r]
            bufs.free()
            assert bufs.bases == {}
            world.barrier("all freed")
            if r == 1:
                raise RuntimeError("rank 1 broke")
            return _gives_up(world, "never complete")  # rank 1 is gone

    got = _every_rank(rvs, run)
    assert str(got[1]) == "rank 1 broke"
    for r in (0, 2):
        message, waited = got[r]
        assert message == f"rank {r} gave up waiting in 'never complete': rank 1: RuntimeError: rank 1 broke"
        assert waited < 5
    _assert_all_released(machine)


def test_a_failure_inside_a_world_is_reported_as_is_and_everything_is_freed(monkeypatch):
    """Rank 2 cannot map rank 3's heap: its own error surfaces (not a cleanup error), the
    other ranks stop waiting at once, and every heap and mapping is released."""
    import types

    from conftest import ROOT
    from tsgen.manifest import Manifest
    from tsgen.runtime import world as world_mod

    machine = Machine()
    machine.fail_open.add((2, 3))
    # rank 2 fails once the others have mapped every heap (and rank 2 those of ranks 0 and
    # 1): they are waiting then, whatever the load on the machine running this
    machine.fail_after = 3 * 3 + 2
    cp = fake_cupy(machine, [0, 1, 2, 3])
    monkeypatch.setattr(world_mod, "cupy_or_error", lambda: cp)
    manifest = Manifest.load(ROOT / "generated" / "allgather.json")
    rvs = localhost_ranks(4, timeout=30)

    def run(r, rv):
        env = {"RANK": str(r), "WORLD_SIZE": "4"}
        with world_mod.World(4, backend=IpcBackend(cp, 4, env=env, rendezvous=rv)) as world:
            world_mod.Buffers(types.SimpleNamespace(manifest=manifest, world=world), 1000)
            world.barrier("call 0: inputs loaded, outputs poisoned")

    t0 = time.monotonic()
    got = _every_rank(rvs, run)
    assert time.monotonic() - t0 < 10
    assert str(got[2]).startswith("rank 2 (GPU 2): cudaIpcOpenMemHandle of rank 3's heap 0")
    for r in (0, 1, 3):
        assert isinstance(got[r], StoreError) and "rank 2: RuntimeSetupError: rank 2 (GPU 2): cudaIpc" in str(got[r])
    assert machine.allocs == {} and machine.mappings == {}  # a heap may be freed before a peer unmapped it


# ---------------------------------------------------------------------------
# packaging and the GPU script's timing comparison
# ---------------------------------------------------------------------------


def test_extras_bring_the_runtime_and_the_generator_needs_none():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    from conftest import ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}  # noqa: E731
    extras = project["optional-dependencies"]
    for cuda in ("12", "13"):
        assert names(extras[f"cuda{cuda}"]) == {f"cupy-cuda{cuda}x", f"nvidia-nvshmem-cu{cuda}",
                                                f"nvshmem4py-cu{cuda}", "nvidia-ml-py"}
    assert not any("cupy" in n or "nvshmem" in n or "nvidia" in n for n in names(project["dependencies"]))


@pytest.mark.parametrize("ipc_us,rc", [(1010.0, 0), (990.0, 0), (1060.0, 1), (900.0, 1)])
def test_compare_bar(tmp_path, ipc_us, rc):
    import json
    import subprocess
    import sys

    from conftest import ROOT

    def rows(t):
        return {"rows": [{"impl": "tsgen", "spec": "allgather", "size": 256 << 20, "time_us": t,
                          "busbw_GBps": 201326592 / t / 1e3}]}  # `tsgen bench --json` rows

    (tmp_path / "s.json").write_text(json.dumps(rows(1000.0)))
    (tmp_path / "i.json").write_text(json.dumps(rows(ipc_us)))
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "ipc_checks.py"), "compare", str(tmp_path / "s.json"),
                        str(tmp_path / "i.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode == rc, p.stdout + p.stderr
    assert ("PASS" if rc == 0 else "FAIL") in p.stdout


def _ipc_checks():
    from conftest import ROOT, load_script

    return load_script(ROOT / "tools" / "ipc_checks.py")


DUMMY_RANKS = """
import os, signal, sys, time
r = int(os.environ["RANK"])
if r == 1:
    time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.8 if r != 2 else 60)  # {hang}
print(f"tsgen: timeout: rank {r} block 0 thread 0 waited 300 ms on entry[1]", flush=True)
sys.exit(2)
"""


@pytest.mark.parametrize("hang", [False, True])
def test_dying_rank_verdict_on_launch_output(hang):
    """The GPU script's verdict over real `tsgen launch` output from dummy ranks: rank 1
    is killed; the others 'time out' on their own (PASS), or rank 2 hangs until the
    launcher stops it (FAIL, naming rank 2)."""
    import io
    import sys

    from tsgen.launch import launch

    code = DUMMY_RANKS if hang else DUMMY_RANKS.replace("60", "0.8")
    out, err = io.StringIO(), io.StringIO()
    rc = launch([sys.executable, "-c", code], 4, out=out, err=err, grace=2.0, kill_after=2.0)
    problems = _ipc_checks().dying_rank_verdict(rc, out.getvalue() + err.getvalue(), 4, 1)
    if not hang:
        assert problems == [], out.getvalue() + err.getvalue()
    else:
        assert problems == ["rank 2 printed no timeout diagnostic",
                            "rank 2 exit code 143 (want 1 or 2: ended on its own)"]


def test_a_rank_whose_context_is_refused_says_why_and_its_peers_stop_at_once(monkeypatch, tmp_path):
    """Three ranks of processes share one GPU under MPS; the server turns rank 2's context away
    (its first stream fails, as measured on an H200 with CUDA_DEVICE_MAX_CONNECTIONS=32 in every
    rank). Rank 2 raises the explaining RuntimeSetupError; the others, waiting for it, stop at once
    with its message instead of waiting out their timeout."""
    from tsgen.runtime import world as world_mod

    machine = Machine()
    cp = fake_cupy(machine, [0])
    refused = threading.local()

    class Stream(cp.cuda.Stream):
        def __init__(self, non_blocking=False):
            if getattr(refused, "here", False):
                raise FakeError("cudaErrorMemoryAllocation: out of memory")
            super().__init__(non_blocking)

    monkeypatch.setattr(cp.cuda, "Stream", Stream)
    monkeypatch.setattr(world_mod, "cupy_or_error", lambda: cp)
    (tmp_path / "control").write_text("")  # an MPS control daemon's pipe
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    rvs = localhost_ranks(3, timeout=30)

    def run(r, rv):
        refused.here = r == 2
        backend = IpcBackend(cp, 3, env={"RANK": str(r), "WORLD_SIZE": "3"}, rendezvous=rv, share_gpus=True)
        with world_mod.World(3, backend=backend, share_gpus=False) as world:  # rank 2 raises here
            assert world.shared
            return _gives_up(world, "first call")

    got = _every_rank(rvs, run)
    assert isinstance(got[2], RuntimeSetupError), got[2]
    why = ("rank 2 on GPU 0: creating the CUDA context failed: cudaErrorMemoryAllocation: out of memory; "
           "under MPS this may be how the server turned this client away")
    assert str(got[2]).startswith(why) and "CUDA_DEVICE_MAX_CONNECTIONS=32; unset it" in str(got[2])
    for r in (0, 1):
        message, waited = got[r]
        assert message.startswith(f"rank {r} gave up waiting in 'first call': rank 2: RuntimeSetupError: {why}")
        assert waited < 5
    _assert_all_released(machine)
