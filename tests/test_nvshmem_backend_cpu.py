"""The NVSHMEM backend (tsgen/runtime/nvshmem.py) against a fake nvshmem4py and a fake
CUDA runtime: ranks are threads with their own rendezvous, as in test_ipc_cpu.py.

The fake keeps NVSHMEM's rules that the backend relies on: init, nvshmem_malloc,
nvshmem_free and finalize are collectives (a barrier over every PE); every PE's heap
holds an allocation at the same offset; nvshmem_ptr gives a peer's heap as this PE
maps it; a PE's unique id must be rank 0's."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from conftest import close_ranks, localhost_ranks, together
from test_ipc_cpu import Machine, fake_cupy
from tsgen.errors import RuntimeSetupError
from tsgen.runtime import nvshmem as nv


class FakeNvshmemJob:
    """What every PE of one job shares: the barrier, the log, each PE's heap base."""

    def __init__(self, size: int, barrier_timeout: float = 20.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=barrier_timeout)
        self.lock = threading.Lock()
        self.log: list[tuple[int, str]] = []
        self.uid: bytes | None = None
        self.heap_base = {pe: 0x7000_0000_0000 + pe * 0x1_0000_0000 for pe in range(size)}

    def record(self, pe: int, what: str) -> None:
        with self.lock:
            self.log.append((pe, what))

    def of(self, pe: int) -> list[str]:
        return [w for p, w in self.log if p == pe]


class FakeUid:
    def __init__(self):
        self._data = np.zeros(1, dtype=[("version", "<i4"), ("internal", "u1", (124,))])

    @property
    def ptr(self) -> int:
        return self._data.ctypes.data


class FakeArray:
    def __init__(self, ptr: int, nbytes: int, offset: int):
        self.data = type("Ptr", (), {"ptr": ptr})()
        self.nbytes, self.offset = nbytes, offset


def fake_lib(job: FakeNvshmemJob, pe_of=lambda rank: rank, fail_init: bool = False) -> nv.NvshmemLib:
    """One PE's view of nvshmem4py (core, bindings, cuda.core.Device)."""
    state = {"pe": None, "next": 0, "live": {}}

    class Core:
        @staticmethod
        def get_unique_id(empty=False):
            uid = FakeUid()
            if not empty:
                uid._data["internal"][0][:8] = np.arange(1, 9)
                job.uid = ctypes.string_at(uid.ptr, uid._data.itemsize)
            return uid

        @staticmethod
        def init(device, uid, rank, nranks, initializer_method):
            assert initializer_method == "uid" and nranks == job.size and device.id == rank
            assert ctypes.string_at(uid.ptr, uid._data.itemsize) == job.uid, "unique id is not rank 0's"
            if fail_init:
                raise RuntimeError("nvshmemi_bootstrap failed")
            state["pe"] = pe_of(rank)
            job.record(state["pe"], "init")
            job.barrier.wait()

        @staticmethod
        def array(shape, dtype):
            (nbytes,) = shape
            offset, state["next"] = state["next"], state["next"] + nbytes + 256
            job.barrier.wait()  # nvshmem_malloc is a collective
            a = FakeArray(job.heap_base[state["pe"]] + offset, nbytes, offset)
            state["live"][a.data.ptr] = a
            job.record(state["pe"], f"malloc {nbytes}")
            return a

        @staticmethod
        def get_peer_array(a, pe):
            return FakeArray(job.heap_base[pe] + a.offset, a.nbytes, a.offset)

        @staticmethod
        def free_array(a):
            job.barrier.wait()  # nvshmem_free is a collective
            del state["live"][a.data.ptr]
            job.record(state["pe"], f"free {a.nbytes}")

        @staticmethod
        def finalize():
            job.barrier.wait()
            assert not state["live"], "finalize with heaps still allocated"
            job.record(state["pe"], "finalize")

    class Bindings:
        my_pe = staticmethod(lambda: state["pe"])
        n_pes = staticmethod(lambda: job.size)

        @staticmethod
        def cumodule_init(handle):
            job.record(state["pe"], f"cumodule_init {handle:#x}")
            return 0

        @staticmethod
        def cumodule_finalize(handle):
            job.record(state["pe"], f"cumodule_finalize {handle:#x}")
            return 0

    class Device:
        def __init__(self, i):
            self.id = i

        def set_current(self):
            pass

    return nv.NvshmemLib(Core, Bindings, Device)


_host = threading.local()


def nvshmem_world(size, job=None, machine=None, timeout=10.0, hosts=None, **lib_kw):
    """`size` fake processes, each an NvshmemBackend (or the exception it raised)."""
    machine, job = machine or Machine(), job or FakeNvshmemJob(size)
    rvs = localhost_ranks(size, timeout=timeout)

    def make(r, rv):
        _host.name = hosts(r) if hosts else "node0"
        env = {"RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r % 4)}
        return nv.NvshmemBackend(fake_cupy(machine, list(range(4))), size, env=env, rendezvous=rv,
                                 lib=fake_lib(job, **lib_kw))

    return job, rvs, together(rvs, make)


@pytest.fixture(autouse=True)
def _per_rank_hostname(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: getattr(_host, "name", "node0"))
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1G")
    yield
    for session in nv._SESSIONS.values():  # fake PEs a test left up (a "dead" rank)
        session.live = False  # nothing to finalize at exit
    nv._SESSIONS.clear()


def test_init_heaps_peer_tables_modules_and_teardown_in_order():
    job, rvs, backends = nvshmem_world(3)
    try:
        assert [b.devices for b in backends] == [{r: r} for r in range(3)]
        assert all(b.nvshmem and b.mesh_problem is None for b in backends)
        bases = together(backends, lambda r, b: b.alloc_heap(4096))
        tables = together(backends, lambda r, b: b.peer_tables(bases[r]))
        for r in range(3):
            # every peer's heap at the same offset as this rank's (symmetric), as nvshmem_ptr maps it
            offset = bases[r][r] - job.heap_base[r]
            assert [int(x) for x in tables[r][r]] == [job.heap_base[q] + offset for q in range(3)]
        together(backends, lambda r, b: b.register_module(0x1000 + r))
        together(backends, lambda r, b: b.close())  # a heap and a module left: close frees both
        for r in range(3):
            assert job.of(r) == ["init", "malloc 4096", f"cumodule_init {0x1000 + r:#x}", "free 4096",
                                 f"cumodule_finalize {0x1000 + r:#x}"]  # NVSHMEM stays up for the next World
        together(backends, lambda r, b: b.finalize())  # what exit does
        assert all(job.of(r)[-1] == "finalize" for r in range(3))
    finally:
        close_ranks(rvs)


def test_hundred_create_use_destroy_cycles_init_once_and_free_every_heap():
    machine, job = Machine(), FakeNvshmemJob(2)
    rvs = localhost_ranks(2, timeout=10)
    try:
        def cycles(r, rv):
            _host.name = "node0"
            lib = fake_lib(job)  # one process: one nvshmem4py
            for _ in range(100):
                b = nv.NvshmemBackend(fake_cupy(machine, [0, 1]), 2, rendezvous=rv, lib=lib,
                                      env={"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)})
                b.peer_tables(b.alloc_heap(1 << 20))
                b.close()
            b.finalize()

        together(rvs, cycles)
        for r in range(2):
            assert job.of(r).count("init") == job.of(r).count("finalize") == 1
            assert job.of(r).count(f"malloc {1 << 20}") == job.of(r).count(f"free {1 << 20}") == 100
    finally:
        close_ranks(rvs)


def test_a_dead_peer_does_not_hang_teardown(capsys):
    """Rank 1 is gone (aborted, never frees): rank 0 does not enter the collective free (nor
    finalize later), with a message; the memory is left to the process's exit."""
    job, rvs, backends = nvshmem_world(2)
    try:
        together(backends, lambda r, b: b.alloc_heap(512))
        rvs[1].abort("RuntimeSetupError: rank 1 died")
        t0 = time.monotonic()
        backends[0].close()
        assert time.monotonic() - t0 < 3
        err = capsys.readouterr().err
        assert ("rank 0 (GPU 0): freeing a heap of 512 bytes skipped (rank 1: RuntimeSetupError: rank 1 died); "
                "NVSHMEM is left to the process's exit") in err
        backends[0].finalize()  # NVSHMEM was given up: finalize is not even tried
        assert "finalize" not in job.of(0)
    finally:
        close_ranks(rvs)


def test_a_rank_that_announced_its_free_gives_up_when_a_peer_aborts_instead():
    """Rank 0 is already waiting to free when rank 1 fails and aborts: rank 1 does not
    announce, rank 0 gives up on the abort: neither enters nvshmem_free (where rank 0 would
    wait forever, holding the GIL)."""
    job, rvs, backends = nvshmem_world(2)
    try:
        bases = together(backends, lambda r, b: b.alloc_heap(512))

        def rank(r, b):
            if r == 1:
                time.sleep(0.3)  # rank 0 is in the store meeting by now
                rvs[1].abort("RuntimeError: rank 1 broke")
            t0 = time.monotonic()
            b.free_heap(bases[r])
            return time.monotonic() - t0

        waited = together(backends, rank)
        assert all(w < 3 for w in waited), waited
        assert all("free 512" not in job.of(pe) for pe in range(2))
    finally:
        close_ranks(rvs)


def test_a_lost_context_touches_nothing(capsys):
    machine = Machine()
    job, rvs, backends = nvshmem_world(2, machine=machine)
    try:
        together(backends, lambda r, b: b.alloc_heap(512))
        machine.dead.add(0)  # rank 0's kernel trapped
        t0 = time.monotonic()
        backends[0].finalize()  # no collective: it would wait for rank 1 inside a dead context
        assert time.monotonic() - t0 < 1
        assert job.of(0) == ["init", "malloc 512"]
        assert "CUDA context lost" in capsys.readouterr().err
    finally:
        close_ranks(rvs)


def test_init_failure_is_named_and_every_rank_stops():
    job, rvs, got = nvshmem_world(2, timeout=5, fail_init=True)
    try:
        for r, e in enumerate(got):
            assert isinstance(e, RuntimeSetupError)
            assert str(e).startswith(f"rank {r} (GPU {r}): NVSHMEM init (unique id over the store) failed: "
                                     "nvshmemi_bootstrap failed")
        assert "joining the world" in rvs[0].aborted()
    finally:
        close_ranks(rvs)


def test_pe_that_is_not_the_rank_is_refused_and_nothing_collective_follows(capsys):
    job, rvs, got = nvshmem_world(2, pe_of=lambda r: 1 - r)
    try:
        for r, e in enumerate(got):
            assert isinstance(e, RuntimeSetupError)
            assert str(e) == f"rank {r} (GPU {r}): NVSHMEM made this process PE {1 - r} of 2, not {r} of 2"
        # the ranks aborted: finalize (a barrier over every PE) is skipped, not left waiting
        assert all("finalize" not in job.of(pe) for pe in range(2))
        assert "nvshmem_finalize skipped" in capsys.readouterr().err
        assert nv._SESSIONS == {}
    finally:
        close_ranks(rvs)


def test_ranks_on_two_hosts_run_nvshmem_kernels_only(monkeypatch):
    """Across hosts the join succeeds (NVSHMEM's transports span hosts), and World refuses
    p2p kernels (peer loads and stores) with a message that names the fix."""
    import types

    from conftest import ROOT
    from tsgen.manifest import Manifest
    from tsgen.runtime import world as world_mod

    job, rvs, backends = nvshmem_world(2, hosts=lambda r: f"node{r}")
    try:
        problem = backends[0].mesh_problem
        assert problem == ("the ranks run on 2 hosts (node0, node1): kernels that load and store peer memory "
                           "need one host; build the spec with params.transport: nvshmem to run across hosts")
        world = types.SimpleNamespace(backend=backends[0])
        with pytest.raises(RuntimeSetupError, match="need one host"):
            world_mod.World.check_mesh(world)
        manifest = Manifest.load(ROOT / "generated" / "allgather_nvshmem.json")
        assert world_mod.device_lib_refusal(manifest, backends[0]) is None
        together(backends, lambda r, b: b.finalize())
    finally:
        close_ranks(rvs)


def test_missing_nvshmem4py_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nvshmem", None)
    with pytest.raises(RuntimeSetupError, match=r"the nvshmem backend needs nvshmem4py and the NVSHMEM library: "
                                                r'`pip install "\.\[cuda13\]"` in the tsgen checkout'):
        nv.import_nvshmem()


def test_unique_id_of_another_size_is_refused():
    job = FakeNvshmemJob(2, barrier_timeout=2)  # rank 0 waits in init for rank 1, which gave up
    rvs = localhost_ranks(2, timeout=5)
    try:
        def make(r, rv):
            _host.name = "node0"
            lib = fake_lib(job)
            if r == 1:  # another NVSHMEM build: a 64-byte unique id
                class Short(FakeUid):
                    def __init__(self):
                        self._data = np.zeros(1, dtype=[("x", "u1", (64,))])

                lib = lib._replace(core=type("C", (lib.core,), {"get_unique_id": staticmethod(lambda empty: Short())}))
            return nv.NvshmemBackend(fake_cupy(Machine(), [0, 1]), 2, rendezvous=rv, lib=lib,
                                     env={"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)})

        got = together(rvs, make)
        assert str(got[1]) == ("rank 1 (GPU 1): NVSHMEM unique id from rank 0 has 128 bytes, this NVSHMEM expects "
                               "64: the ranks load different NVSHMEM versions")
    finally:
        close_ranks(rvs)
