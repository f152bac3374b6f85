"""The NCCL / SymmetricMemory baselines (tsgen.bench.nccl) without GPUs: sizes, counts,
bus-bandwidth factors, the rank-seeded data, the no-multicast guards, and the worker
launcher (tsgen.bench.workers, under tsgen launch, with fake workers). The real NCCL /
SymmetricMemory run is at the end and needs torch and 2 GPUs."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import numpy as np
import pytest

import tsgen.bench.nccl as bl
from tsgen.bench import sizes as S
from tsgen.bench import workers as W
from tsgen.env import NO_MULTICAST

FORCED = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
assert FORCED == NO_MULTICAST

# ---------------------------------------------------------------------------
# bus bandwidth
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
def test_busbw_factors_match_nccl_tests(n):
    assert bl.busbw_factor("allgather", n) == pytest.approx((n - 1) / n)
    assert bl.busbw_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bl.busbw_factor("all_to_all", n) == pytest.approx((n - 1) / n)
    assert bl.busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bl.busbw_factor("broadcast", n) == 1.0


def test_busbw_factor_aliases_and_errors():
    assert bl.busbw_factor("allreduce", 4) == 1.5
    assert bl.busbw_factor("all_gather", 4) == 0.75
    assert bl.busbw_factor("AllToAll", 4) == 0.75
    with pytest.raises(ValueError):
        bl.busbw_factor("gather", 4)


def test_make_row_bandwidths():
    # 1 MiB in 10 us: 104.8576 GB/s algbw; all_reduce on 4 ranks: x1.5
    row = bl.make_row("nccl", "all_reduce", "bf16", 1 << 20, 4, [12.0, 10.0, 9.0, 10.0, 11.0], wrong=0,
                      mode="graph")
    for field in bl.ROW_FIELDS:
        assert field in row
    assert row["time_us"] == 10.0 and row["time_us_min"] == 9.0
    assert row["algbw_GBps"] == pytest.approx(104.8576)
    assert row["busbw_GBps"] == pytest.approx(104.8576 * 1.5)
    assert row["dtype"] == "bfloat16" and row["wrong"] == 0 and row["skipped"] is None
    assert row["mode"] == "graph"
    skipped = bl.make_row("symm_mem_one_shot", "all_reduce", "int32", 1024, 4, None, None, skipped="refused")
    assert skipped["time_us"] is None and skipped["busbw_GBps"] is None and skipped["skipped"] == "refused"


# ---------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------


def test_parse_sizes_lists_and_ranges():
    assert S.parse_sizes("64K,1M,256M") == [64 << 10, 1 << 20, 256 << 20]
    assert S.parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert S.parse_sizes("1M:1G:4") == [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
    assert S.parse_sizes("4096") == [4096]
    assert S.parse_size("64KiB") == S.parse_size("64kb") == S.parse_size("64K") == 65536
    assert S.parse_size("2G") == 2 << 30


@pytest.mark.parametrize("bad", ["", "1X", "1K:", "8K:1K", "1K:1M:1", "1K:1M:x", "1K:2K:2:2", "-1"])
def test_parse_sizes_rejects(bad):
    with pytest.raises(S.BenchConfigError):
        S.parse_sizes(bad)


# ---------------------------------------------------------------------------
# element counts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,item", [("bfloat16", 2), ("float16", 2), ("float32", 4), ("int32", 4)])
def test_elem_counts_per_op(dtype, item):
    w, nbytes = 4, 1 << 20
    total = nbytes // item
    assert bl.elem_counts("allgather", nbytes, dtype, w) == bl.Counts(total // w, total, False)
    assert bl.elem_counts("reduce_scatter", nbytes, dtype, w) == bl.Counts(total, total // w, False)
    assert bl.elem_counts("all_to_all", nbytes, dtype, w) == bl.Counts(total, total, False)
    assert bl.elem_counts("all_reduce", nbytes, dtype, w) == bl.Counts(total, total, True)
    assert bl.elem_counts("broadcast", nbytes, dtype, w) == bl.Counts(total, total, True)
    # bytes touched in a rank's own buffers
    assert bl.elem_counts("allgather", nbytes, dtype, w).footprint(item) == nbytes + nbytes // w
    assert bl.elem_counts("all_to_all", nbytes, dtype, w).footprint(item) == 2 * nbytes
    assert bl.elem_counts("all_reduce", nbytes, dtype, w).footprint(item) == nbytes


@pytest.mark.parametrize("op", ["allgather", "reduce_scatter", "all_to_all"])
def test_elem_counts_needs_world_times_itemsize(op):
    # 4 ranks x 4 bytes = 16: 24 bytes is a multiple of the itemsize, not of 16
    with pytest.raises(bl.BaselineConfigError, match="world x itemsize"):
        bl.elem_counts(op, 24, "float32", 4)
    with pytest.raises(bl.BaselineConfigError):
        bl.elem_counts(op, 6, "bfloat16", 4)
    assert bl.elem_counts(op, 32, "float32", 4).n_in in (2, 8)
    # 3 ranks: 96 bytes of bf16 = 48 elements = 3 x 16
    assert bl.elem_counts(op, 96, "bf16", 3).n_out in (16, 48)


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_elem_counts_needs_itemsize_only(op):
    assert bl.elem_counts(op, 6, "bfloat16", 4) == bl.Counts(3, 3, True)
    with pytest.raises(bl.BaselineConfigError, match="itemsize"):
        bl.elem_counts(op, 6, "float32", 4)


def test_elem_counts_rejects_nonsense():
    with pytest.raises(bl.BaselineConfigError):
        bl.elem_counts("all_reduce", 0, "float32", 4)
    with pytest.raises(bl.BaselineConfigError):
        bl.elem_counts("all_reduce", 1024, "float64", 4)
    with pytest.raises(bl.BaselineConfigError):
        bl.elem_counts("gather", 1024, "float32", 4)


def test_rotation_slots_and_calls():
    l2 = 50 << 20
    # below 64 MiB: the rotated set exceeds 2x the L2
    for nbytes, foot in [(64 << 10, 64 << 10), (1 << 20, 2 << 20), (32 << 20, 32 << 20), (63 << 20, 126 << 20)]:
        slots = S.rotation_slots(nbytes, foot, l2)
        assert slots * foot > 2 * l2
        assert (slots - 1) * foot <= 2 * l2
    assert S.rotation_slots(64 << 20, 64 << 20, l2) == 1
    assert S.rotation_slots(256 << 20, 256 << 20, l2) == 1
    assert S.rotation_slots(1 << 20, 1 << 20, l2, rotate=False) == 1
    assert S.rotation_slots(1024, 1024, l2) == S.MAX_SLOTS  # capped
    # an L2 larger than 50 MiB (H200: 60 MB) counts
    assert S.rotation_slots(1 << 20, 1 << 20, 60_000_000) * (1 << 20) > 120_000_000
    assert S.calls_per_sample(20, 1) == 20
    assert S.calls_per_sample(20, 3) == 21
    assert S.calls_per_sample(20, 1601) == 1601
    assert S.slot_stride(1, 2) == 2048 and S.slot_stride(2048, 2) == 2048 and S.slot_stride(2049, 2) == 4096


# ---------------------------------------------------------------------------
# the rank-seeded data: simulate each collective in NumPy from the inputs and
# compare with what the worker will expect
# ---------------------------------------------------------------------------


def _simulate(op, world, counts):
    ins = [np.asarray(bl.input_values(op, r, world, np.arange(counts.n_in), counts.n_in)) for r in range(world)]
    if op == "all_reduce":
        return [sum(ins) for _ in range(world)]
    if op == "broadcast":
        return [ins[0].copy() for _ in range(world)]
    if op == "allgather":
        return [np.concatenate(ins) for _ in range(world)]
    if op == "reduce_scatter":
        total = sum(ins)
        return [total[r * counts.n_out:(r + 1) * counts.n_out] for r in range(world)]
    c = counts.n_in // world  # all_to_all
    return [np.concatenate([ins[s][r * c:(r + 1) * c] for s in range(world)]) for r in range(world)]


@pytest.mark.parametrize("op", bl.OPS)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_expected_values_match_a_simulation(op, world):
    counts = bl.elem_counts(op, 4 * world * 96, "float32", world)
    outs = _simulate(op, world, counts)
    for r in range(world):
        want = np.asarray(bl.expected_values(op, r, world, np.arange(counts.n_out), counts.n_out))
        assert want.shape == (counts.n_out,)
        np.testing.assert_array_equal(outs[r], want)
        # every value is a small integer, exact in bf16 (<= 256) and never the sentinel
        assert want.min() >= 0 and want.max() <= 256
        ins = np.asarray(bl.input_values(op, r, world, np.arange(counts.n_in), counts.n_in))
        assert ins.min() >= 0 and ins.max() <= 256
    if op in ("all_reduce", "broadcast"):  # in place: a no-op must show up as wrong
        r = world - 1
        ins = np.asarray(bl.input_values(op, r, world, np.arange(counts.n_in), counts.n_in))
        assert (ins != np.asarray(bl.expected_values(op, r, world, np.arange(counts.n_out), counts.n_out))).any()


def test_data_distinguishes_ranks():
    # a collective that swapped ranks' chunks would be counted wrong
    world, counts = 4, bl.elem_counts("allgather", 4 * 4 * 64, "float32", 4)
    a = np.asarray(bl.input_values("allgather", 1, world, np.arange(counts.n_in), counts.n_in))
    b = np.asarray(bl.input_values("allgather", 2, world, np.arange(counts.n_in), counts.n_in))
    assert (a != b).all()


# ---------------------------------------------------------------------------
# no NVLink multicast, ever
# ---------------------------------------------------------------------------


def test_force_no_multicast_overwrites(monkeypatch):
    from tsgen.env import force_no_multicast

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    force_no_multicast()
    for key, value in FORCED.items():
        assert os.environ[key] == value
    env = force_no_multicast({"NCCL_NVLS_ENABLE": "1", "X": "y"})
    assert env == {**FORCED, "X": "y"}


def test_child_env_forces_too():
    env = W.child_env({"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "PATH": "/usr/bin"})
    for key, value in FORCED.items():
        assert env[key] == value
    assert env["PATH"] == "/usr/bin"
    assert str(W.Path(W.__file__).resolve().parents[2]) in env["PYTHONPATH"].split(os.pathsep)


@pytest.mark.parametrize("name", ["multimem", "symm_mem_multimem", "multimem_all_reduce_",
                                  "multimem_one_shot_all_reduce", "nccl_nvls", "NVLS", "symm_mem_multicast"])
def test_multimem_backends_raise(name):
    with pytest.raises(bl.MulticastForbiddenError):
        bl.resolve_backends("all_reduce", [name])
    with pytest.raises(bl.MulticastForbiddenError):
        bl.resolve_backends("all_reduce", ["nccl", name])


@pytest.mark.parametrize("algo", ["multimem", "multimem_all_reduce_", "multimem_one_shot_all_reduce",
                                  "symm_mem_multimem"])
def test_multimem_symm_ops_raise(algo):
    with pytest.raises(bl.MulticastForbiddenError):
        bl.symm_mem_op_name(algo)


def test_symm_mem_ops_allowed():
    assert bl.symm_mem_op_name("one_shot") == "one_shot_all_reduce"
    assert bl.symm_mem_op_name("symm_mem_two_shot") == "two_shot_all_reduce_"
    with pytest.raises(bl.BaselineConfigError):
        bl.symm_mem_op_name("three_shot")
    # the module never names a multimem operator it could call
    for name in bl.SYMM_MEM_OPS.values():
        assert "multimem" not in name


def test_run_baselines_refuses_multimem_before_starting_anything(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("no worker may start")

    monkeypatch.setattr(bl, "launch_workers", boom)
    with pytest.raises(bl.MulticastForbiddenError):
        bl.run_baselines("all_reduce", "bfloat16", [1 << 20], 4, backends=("symm_mem_multimem",))


def test_resolve_backends():
    assert bl.resolve_backends("all_reduce") == ["nccl", "symm_mem_one_shot", "symm_mem_two_shot"]
    assert bl.resolve_backends("allgather") == ["nccl"]
    assert bl.resolve_backends("all_reduce", "nccl,symm_mem_two_shot") == ["nccl", "symm_mem_two_shot"]
    assert bl.resolve_backends("all_reduce", ["symm_mem", "symm_mem_one_shot"]) == [
        "symm_mem_one_shot", "symm_mem_two_shot"]
    with pytest.raises(bl.BaselineConfigError):
        bl.resolve_backends("all_reduce", ["mpi"])
    assert bl.skip_reason("symm_mem_one_shot", "allgather")
    assert bl.skip_reason("symm_mem_one_shot", "all_reduce") is None
    assert bl.skip_reason("nccl", "broadcast") is None


@pytest.mark.parametrize("kwargs", [dict(world=1), dict(sizes=[24], op="allgather", dtype="float32"),
                                    dict(op="gather"), dict(dtype="float64"), dict(devices=[0, 0, 1, 2]),
                                    dict(iters=0)])
def test_run_baselines_validates_before_launch(monkeypatch, kwargs):
    monkeypatch.setattr(bl, "launch_workers", lambda *a, **k: pytest.fail("launched"))
    args = dict(op="all_reduce", dtype="bfloat16", sizes=[1 << 20], world=4)
    args.update(kwargs)
    with pytest.raises(bl.BaselineConfigError):
        bl.run_baselines(**args)


def test_run_baselines_passes_config_and_sorts(monkeypatch):
    seen = {}

    def fake(cfg, world, timeout):
        seen.update(cfg=cfg, world=world, timeout=timeout)
        rows = []
        for nbytes in reversed(cfg["sizes"]):
            for b in reversed(cfg["backends"]):
                rows.append(bl.make_row(b, cfg["op"], cfg["dtype"], nbytes, world, [1.0]))
        return rows

    monkeypatch.setattr(bl, "launch_workers", fake)
    rows = bl.run_baselines("allreduce", "bf16", "64K,1M", 4, timeout=12)
    cfg = seen["cfg"]
    assert cfg["op"] == "all_reduce" and cfg["dtype"] == "bfloat16" and cfg["sizes"] == [65536, 1 << 20]
    assert cfg["init_method"] == "env://" and cfg["worker"] == "tsgen.bench.nccl:worker" and seen["timeout"] == 12
    assert cfg["devices"] == [0, 1, 2, 3]
    assert [(r["bytes"], r["backend"]) for r in rows] == [
        (65536, "nccl"), (65536, "symm_mem_one_shot"), (65536, "symm_mem_two_shot"),
        (1 << 20, "nccl"), (1 << 20, "symm_mem_one_shot"), (1 << 20, "symm_mem_two_shot")]


# ---------------------------------------------------------------------------
# the launcher, with fake workers (no torch needed)
# ---------------------------------------------------------------------------

FAKE_WORKER = textwrap.dedent('''
    import json, os, sys, time, traceback
    from pathlib import Path
    cfg = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])  # tsgen launch's environment
    Path(cfg["error_dir"], f"pid-{rank}").write_text(str(os.getpid()))
    mode = cfg["mode"]
    try:
        if mode == "ok":
            if rank == 0:
                env = {k: os.environ.get(k) for k in cfg["keys"]}
                Path(cfg["result_path"]).write_text(json.dumps([{"env": env, "argv": sys.argv[1:],
                                                                 "world": os.environ["WORLD_SIZE"]}]))
        elif mode == "fail":
            if rank == 1:
                time.sleep(0.2)
                raise ValueError("planted failure on rank one")
            time.sleep(120)  # the peers hang, as they would in NCCL
        elif mode == "hang":
            time.sleep(120)
        elif mode == "crash":
            if rank == 0:
                print("about to die")
                sys.stdout.flush()
                os._exit(7)
            time.sleep(120)
    except BaseException:
        Path(cfg["error_dir"], f"error-{rank}.txt").write_text(f"rank {rank}:\\n" + traceback.format_exc())
        os._exit(1)
''')


@pytest.fixture()
def fake_worker(tmp_path, monkeypatch):
    """[python, fake_worker.py]; the pids its ranks wrote are collected (the temporary folder is
    removed with the run, so the pid files are copied out as they appear)."""
    path = tmp_path / "fake_worker.py"
    path.write_text(FAKE_WORKER)
    pids = []
    real = W._failure

    def spy(tmp, code, timeout):
        pids.extend(int(f.read_text()) for f in tmp.glob("pid-*"))
        return real(tmp, code, timeout)

    monkeypatch.setattr(W, "_failure", spy)
    return [sys.executable, str(path)], pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_launcher_passes_forced_env(fake_worker, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    out = W.launch_workers({"mode": "ok", "keys": list(FORCED)}, 3, timeout=60, argv=fake_worker[0])
    assert out[0]["env"] == FORCED
    assert out[0]["world"] == "3" and out[0]["argv"][0].endswith("config.json")


def test_launcher_worker_failure_stops_everyone(fake_worker):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        W.launch_workers({"mode": "fail"}, 3, timeout=60, argv=fake_worker[0])
    assert time.monotonic() - t0 < 30
    text = str(err.value)
    assert "rank 1 failed" in text and "planted failure on rank one" in text and "Traceback" in text
    assert isinstance(err.value, W.BaselineRunError)
    assert len(fake_worker[1]) == 3 and not any(_alive(p) for p in fake_worker[1])


def test_launcher_crash_without_traceback_shows_output(fake_worker):
    with pytest.raises(W.BaselineRunError) as err:
        W.launch_workers({"mode": "crash"}, 2, timeout=60, argv=fake_worker[0])
    assert "rank 0 failed (exit code 7)" in str(err.value) and "about to die" in str(err.value)


def test_launcher_timeout_kills(fake_worker):
    t0 = time.monotonic()
    with pytest.raises(W.BaselineRunError, match="timed out"):
        W.launch_workers({"mode": "hang"}, 2, timeout=2, argv=fake_worker[0])
    assert time.monotonic() - t0 < 30
    assert len(fake_worker[1]) == 2 and not any(_alive(p) for p in fake_worker[1])


def test_a_sigterm_during_a_baseline_stops_the_suite(fake_worker):
    """A suite's time limit (timeout's SIGTERM) lands while a baseline's ranks run: the ranks are
    stopped and the suite's own handler gets the signal (suites.Stopped, after which it writes the
    entries it finished), not a BaselineRunError for one baseline with the suite going on (the
    moe fp8 suite of 2026-11-27 lost its finished entry so)."""
    import signal
    import threading

    from tsgen.bench.suites import Stopped, stop_on_signals

    old = signal.getsignal(signal.SIGTERM)
    stop_on_signals()
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(Stopped):
            W.launch_workers({"mode": "hang"}, 2, timeout=60, argv=fake_worker[0])
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)


def test_run_baselines_rejects_bad_sizes_before_launch(monkeypatch):
    monkeypatch.setattr(bl, "launch_workers", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(bl.BaselineConfigError, match="world x itemsize"):
        bl.run_baselines("allgather", "float32", [24], 4)


def test_best_baselines_times_both_settings_in_one_launch(monkeypatch):
    """Graph + rotated buffers and eager on one buffer: one launch of the workers with both
    settings (starting processes and communicators twice cost more than the timing), the
    faster row per backend and size kept, named by its setting."""
    launches = []

    def fake(cfg, world, timeout):
        launches.append(cfg)
        times = {0: {65536: 50.0, 1 << 20: 30.0}, 1: {65536: 20.0, 1 << 20: 40.0}}  # eager wins small only
        return [dict(bl.make_row("nccl", cfg["op"], cfg["dtype"], n, world, [times[i][n]]), config_index=i)
                for i in range(len(cfg["configs"])) for n in cfg["sizes"]]

    monkeypatch.setattr(bl, "launch_workers", fake)
    rows = bl.best_baselines("allgather", "bfloat16", [65536, 1 << 20], 2, backends=("nccl",))
    assert len(launches) == 1
    assert launches[0]["configs"] == [{"use_graphs": True, "rotate": True}, {"use_graphs": False, "rotate": False}]
    got = {r["bytes"]: (r["config"], r["time_us"]) for r in rows}
    assert got == {65536: ("eager, one buffer", 20.0), 1 << 20: ("graph+rotate", 30.0)}
    assert all("config_index" not in r for r in rows)


# ---------------------------------------------------------------------------
# with torch but no GPU: the whole worker path over gloo on CPU tensors
# (data, first-call check, collective calls, consensus, rows)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", bl.OPS)
def test_gloo_dry_run(op):
    pytest.importorskip("torch", reason="torch is not installed: the worker can't run here")
    world = 3
    rows = bl.run_baselines(op, "bfloat16", [world * 2 * 64], world, iters=2, warmup=1, reps=2,
                            timeout=120, rotate=False, device_type="cpu")
    ran = [r for r in rows if not r["skipped"]]
    assert [r["backend"] for r in ran] == ["nccl"]
    assert ran[0]["wrong"] == 0 and ran[0]["mode"] == "eager" and ran[0]["time_us"] > 0
    if op == "all_reduce":
        assert {r["backend"] for r in rows if r["skipped"]} == {"symm_mem_one_shot", "symm_mem_two_shot"}


def test_gloo_dry_run_of_two_settings_in_one_launch():
    """The worker times every setting it is given on the same communicators, each row tagged."""
    pytest.importorskip("torch", reason="torch is not installed: the worker can't run here")
    world = 2
    rows = bl.run_baselines("allgather", "bfloat16", [world * 2 * 64], world, iters=2, warmup=1, reps=2,
                            timeout=120, device_type="cpu", backends=("nccl",),
                            configs=[{"use_graphs": False, "rotate": False}, {"use_graphs": False, "rotate": True}])
    assert sorted(r["config_index"] for r in rows) == [0, 1]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)


# ---------------------------------------------------------------------------
# on GPUs (skipped without torch or with fewer than 2 GPUs)
# ---------------------------------------------------------------------------


def _gpus() -> int:
    torch = pytest.importorskip("torch", reason="torch is not installed: the GPU baselines can't run here")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs 2 CUDA GPUs; torch sees {n}")
    return n


@pytest.mark.gpu
@pytest.mark.parametrize("op", bl.OPS)
def test_gpu_baselines_correct(op):
    world = min(_gpus(), 4)
    sizes = [world * 64 << 10, world << 20]
    rows = bl.run_baselines(op, "bfloat16", sizes, world, iters=4, warmup=1, reps=3, timeout=240)
    ran = [r for r in rows if not r["skipped"]]
    assert any(r["backend"] == "nccl" for r in ran)
    for r in ran:
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0 and r["busbw_GBps"] > 0
    json.dumps(rows)
