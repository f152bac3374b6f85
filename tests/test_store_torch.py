"""The ipc and nvshmem backends' rendezvous over torch.distributed, on CPU: processes of a gloo
process group, and processes started by torchrun (its agent's store), meet through the store
tsgen.runtime.store chooses (the same call the backends make: `shared(launcher_world(...))`),
exchange values, and a rank that aborts releases the others within seconds. Skipped without
torch (CI has none); tests/test_store.py covers the choice itself and tsgen's own store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from tsgen.launch import free_port

pytest.importorskip("torch.distributed")

PY = sys.executable
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TSGEN_STORE", "TSGEN_STORE_SECRET", "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS")

# One rank: optionally a gloo process group made by hand (no launcher variables at all), then
# the rendezvous exactly as IpcBackend / NvshmemBackend make it; values exchanged, then (when
# asked) rank ABORTER aborts after a pause while the others wait in a barrier. Prints one JSON line.
WORKER = """
import json, os, sys, time
from tsgen.runtime import store
from tsgen.runtime.ipc import launcher_world
group, aborter = sys.argv[1], int(sys.argv[2])
if group != "none":
    import torch.distributed as dist
    rank, size, port = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
info = launcher_world(os.environ)
rv = store.shared(info.master_addr, info.master_port, info.rank, info.size)
out = {"rank": info.rank, "size": info.size, "launcher": info.launcher, "where": rv.kv.where,
       "values": [v.decode() for v in rv.all_gather("hello", f"from {info.rank}".encode())]}
rv.barrier("after hello")
if aborter >= 0:
    if info.rank == aborter:
        time.sleep(0.5)
        rv.abort("RuntimeError: rank failed on purpose")
    else:
        t0 = time.monotonic()
        try:
            rv.barrier("the aborting rank never comes")
            out["abort"] = "the barrier completed"
        except store.StoreError as e:
            out["abort"], out["waited"] = str(e), time.monotonic() - t0
sys.stdout.write("RESULT " + json.dumps(out) + "\\n")  # one write: the ranks share the pipe
sys.stdout.flush()
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(TSGEN_STORE_TIMEOUT="30", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def _results(text: str) -> list[dict]:
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]
    return sorted(rows, key=lambda r: r["rank"])


def _check(rows: list[dict], size: int, launcher: str, where: str, aborter: int) -> None:
    assert len(rows) == size, rows
    for r, row in enumerate(rows):
        assert (row["rank"], row["size"], row["launcher"]) == (r, size, launcher)
        assert row["where"].startswith(where), row["where"]
        assert row["values"] == [f"from {q}" for q in range(size)]
        if aborter >= 0 and r != aborter:
            assert row["abort"] == (f"rank {r} gave up waiting in 'the aborting rank never comes': rank {aborter}: "
                                    "RuntimeError: rank failed on purpose"), row
            assert row["waited"] < 5, row  # 0.5 s of the aborter's pause, then one poll


@pytest.mark.parametrize("size,aborter", [(2, 1), pytest.param(4, 3, marks=pytest.mark.slow), (3, -1)],
                         ids=["2-ranks-abort", "4-ranks-abort", "3-ranks"])
def test_gloo_process_group_ranks_meet_in_its_store(size, aborter):
    """Ranks of a gloo group started by hand (no launcher variables): rank and size come from the
    group, the store is the group's, and an abort reaches every rank within seconds."""
    port = free_port()
    procs = [subprocess.Popen([PY, "-c", WORKER, "gloo", str(aborter), str(r), str(size), str(port)], cwd=ROOT,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    _check(_results("\n".join(outs)), size, "torch.distributed", "torch.distributed's default store", aborter)
    # leaving says nothing to a store whose server (rank 0) may be gone: torch printed a stack
    assert not any("sendBytes failed" in out or "Traceback" in out for out in outs), outs


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(PY)) or shutil.which("torchrun")
    return [exe] if exe else [PY, "-m", "torch.distributed.run"]


@pytest.mark.slow  # a torchrun agent and its ranks: ~10 s on a busy 2-core machine
@pytest.mark.parametrize("group,where,launcher", [
    ("none", "torchrun agent's store at", "torchrun"),
    ("env", "torch.distributed's default store", "torch.distributed"),
], ids=["agent-store", "process-group"])
def test_torchrun_ranks_meet_without_tsgen_launch(tmp_path, group, where, launcher):
    """Under `torchrun --standalone` (no tsgen launch, no secret): the ranks meet in torchrun's agent
    store, or in the process group's when the script made one; an abort still ends the waits."""
    script = tmp_path / "rank.py"
    text = WORKER
    if group == "env":  # the usual torchrun script: init_process_group from torchrun's variables
        text = text.replace('if group != "none":', 'if False:').replace(
            "info = launcher_world", 'import torch.distributed as dist\ndist.init_process_group("gloo")\n'
                                    "info = launcher_world")
    script.write_text(text)
    t0 = time.monotonic()
    run = subprocess.run(_torchrun() + ["--standalone", "--nproc-per-node", "3", str(script), "none", "1"], cwd=ROOT,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:]
    _check(_results(run.stdout), 3, launcher, where, 1)
    assert time.monotonic() - t0 < 60


def test_a_process_group_made_again_gets_a_new_rendezvous(monkeypatch):
    """shared() reuses the rendezvous while the default group lives, and drops it (without
    touching the old store) when the group was destroyed and made again: a new store."""
    import atexit

    import torch.distributed as dist

    from tsgen.runtime import store

    monkeypatch.setattr(store, "_shared", {})
    made = []
    monkeypatch.setattr(atexit, "register", made.append)
    monkeypatch.setattr(atexit, "unregister", made.remove)
    seen = []
    for _ in range(2):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            rv = store.shared("127.0.0.1", 29500, 0, 1)
            assert store.shared("127.0.0.1", 29500, 0, 1) is rv  # one per process while the group lives
            assert rv.kv.where == "torch.distributed's default store"
            assert rv.all_gather("solo", b"x") == [b"x"]
            seen.append(rv)
        finally:
            dist.destroy_process_group()
    assert seen[0] is not seen[1] and seen[0].closed and not seen[1].closed
    assert made == [seen[1].close]  # the dropped one is not left at exit


def test_ipc_heaps_and_teardown_over_a_torch_store():
    """The IPC backend's handle exchange, free barrier and abort over a torch store (threads stand
    for processes against tests/test_ipc_cpu.py's fake CUDA, as there over tsgen's store)."""
    from conftest import close_ranks, together
    from test_ipc_cpu import _assert_all_released, _assert_all_released_but_for, ipc_world

    machine, rvs, backends = ipc_world(3, timeout=20, store="torch")
    try:
        assert all(rv.kv.where.startswith("torch TCPStore at 127.0.0.1:") for rv in rvs)
        bases = together(backends, lambda r, b: b.alloc_heap(4096))
        tables = together(backends, lambda r, b: b.peer_tables(bases[r]))
        for r in range(3):
            for q in range(3):  # every peer's heap through a mapping of exactly its base
                addr = int(tables[r][r][q])
                assert addr == bases[r][r] if q == r else machine.mappings[addr] == bases[q][q]
        assert together(backends, lambda r, b: b.free_heap(bases[r])) == [None] * 3
        _assert_all_released(machine)
        # a failed rank: the others free their heaps without waiting for it
        bases = together(backends, lambda r, b: b.alloc_heap(256))
        together(backends, lambda r, b: b.peer_tables(bases[r]))
        rvs[0].abort("RuntimeSetupError: kernel failed")
        t0 = time.monotonic()
        together(backends[1:], lambda r, b: b.free_heap(bases[r + 1]))
        assert time.monotonic() - t0 < 5
        backends[0].free_heap(bases[0])
        _assert_all_released_but_for(machine, 2)  # ranks 1 and 2 freed while rank 0 still mapped them
    finally:
        close_ranks(rvs)
