"""`tsgen launch` on CPU with dummy ranks: environment, rank-prefixed output,
and a failing (or killed) rank ending all the others (on their own within the
grace period, or stopped after it) with its exit code."""

import io
import sys
import time

import pytest

from tsgen.launch import launch, main

PY = sys.executable


def run(code: str, nproc: int = 3, **kw):
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    kw.setdefault("grace", 2.0)
    rc = launch([PY, "-c", code], nproc, out=out, err=err, kill_after=2.0, **kw)
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - t0


def test_all_ranks_succeed_with_torchrun_environment():
    rc, out, err, _ = run("import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], "
                          "os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'], os.environ['NCCL_NVLS_ENABLE'], "
                          "os.environ['NVSHMEM_DISABLE_NVLS'], os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'])")
    assert rc == 0, err
    lines = sorted(out.splitlines())
    assert lines == [f"[rank {r}] {r} 3 {r} 127.0.0.1 0 1 1" for r in range(3)]


def test_multicast_stays_off_even_if_the_parent_enabled_it(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    rc, out, _, _ = run("import os; print(os.environ['NCCL_NVLS_ENABLE'])", nproc=1)
    assert rc == 0 and out.strip() == "[rank 0] 0"


def test_a_failing_rank_ends_the_others_with_its_code():
    # rank 1 fails after a second (so every rank has started); the others would sleep a minute
    rc, out, err, elapsed = run(
        "import os, sys, time\n"
        "r = int(os.environ['RANK'])\n"
        "print('start', flush=True)\n"
        "(time.sleep(1), sys.exit(3)) if r == 1 else time.sleep(60)\n")
    assert rc == 3
    assert "rank 1 exited with 3" in err
    assert elapsed < 20
    assert out.count("start") == 3


def test_the_others_get_the_grace_period_to_end_on_their_own():
    """A rank dies; the others' waits time out (here: they exit 7 a moment later) and
    say so themselves instead of being killed; the dead rank's code is returned."""
    rc, out, err, elapsed = run(
        "import os, sys, time\n"
        "r = int(os.environ['RANK'])\n"
        "if r == 1: time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(1.5); print('tsgen: timeout: rank', r, flush=True); sys.exit(7)\n", grace=20.0)
    assert rc == 3, err
    assert "rank 1 exited with 3; the other ranks get 20 s to end on their own" in err
    assert sorted(l for l in out.splitlines() if "timeout" in l) == [
        "[rank 0] tsgen: timeout: rank 0", "[rank 2] tsgen: timeout: rank 2"]
    assert err.splitlines()[-1] == "tsgen launch: exit codes: rank 0: 7, rank 1: 3, rank 2: 7"
    assert elapsed < 15


def test_ranks_still_running_after_the_grace_period_are_stopped():
    rc, _, err, elapsed = run(
        "import os, sys, time\n"
        "(time.sleep(0.3), sys.exit(4)) if os.environ['RANK'] == '0' else time.sleep(60)\n", nproc=2, grace=1.0)
    assert rc == 4 and elapsed < 15, err
    assert "stopping the ranks still running 1 s after rank 0 failed" in err
    assert err.splitlines()[-1] == "tsgen launch: exit codes: rank 0: 4, rank 1: 143"  # SIGTERM


def test_a_rank_killed_by_a_signal_is_a_failure():
    rc, _, err, elapsed = run(
        "import os, signal, time\n"
        "if os.environ['RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n", nproc=2)
    assert rc == 128 + 9 and elapsed < 20, err


def test_stderr_is_prefixed_too():
    rc, _, err, _ = run("import sys; sys.stderr.write('oops\\n')", nproc=2)
    assert rc == 0 and sorted(l for l in err.splitlines() if "oops" in l) == ["[rank 0] oops", "[rank 1] oops"]


def test_timeout_ends_every_rank():
    rc, _, err, elapsed = run("import time; time.sleep(60)", nproc=2, timeout=1.0)
    assert rc == 124 and "still running" in err and elapsed < 20


def test_module_entry_point_and_bad_arguments():
    assert main(["--nproc", "2", "--", PY, "-c", "pass"]) == 0
    assert main(["--nproc", "2", "--"]) == 2
    with pytest.raises(ValueError):
        launch([PY], 0)


def test_cli_launch_returns_the_rank_exit_code():
    import subprocess

    proc = subprocess.run([PY, "-m", "tsgen", "launch", "--nproc", "2", "--", PY, "-c",
                           "import os, sys; sys.exit(5 if os.environ['RANK'] == '1' else 0)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr


def test_a_signal_to_the_launcher_stops_every_rank(tmp_path):
    """timeout(1) or a scheduler sends SIGTERM to the launcher: the ranks (in sessions of their
    own) must end with it, not outlive it holding GPUs."""
    import os
    import signal
    import subprocess

    pids = tmp_path / "pids"
    # each rank writes its pid to a side file and renames it into place: the test never reads a file that open()
    # has created and write() not yet filled (an empty read, on a loaded machine)
    code = (f"import os, time; p = {str(pids)!r} + os.environ['RANK']; open(p + '.tmp', 'w').write(str(os.getpid())); "
            "os.replace(p + '.tmp', p); time.sleep(60)")
    proc = subprocess.Popen([PY, "-m", "tsgen.launch", "--nproc", "2", "--", PY, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"pids{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [int((tmp_path / f"pids{r}").read_text()) for r in range(2)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "tsgen launch: got signal 15; stopping the ranks" in err
    for pid in ranks:
        for _ in range(100):  # ended: gone, or a zombie (dead; reaped by the launcher or, orphaned, by init)
            if not _still_running(pid, str(pids)):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"rank process {pid} outlived the launcher")


def _still_running(pid: int, marker: str) -> bool:
    """Whether process `pid` is alive (not a zombie) and still the rank (its command line holds `marker`: a pid
    reused by another process on a busy machine is not the rank)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: only whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z" and marker.encode() in cmdline


@pytest.mark.parametrize("chain", [False, True])
def test_a_signal_reaches_the_callers_handler_only_when_chained(chain):
    """A bench suite under a time limit: the SIGTERM that stops a baseline's ranks must also stop
    the suite (its handler raises; the suite then writes the entries it finished), not come back as
    one baseline's failure (exit code 143) with the suite going on to the next entry."""
    import os
    import signal
    import threading

    class SuiteStopped(BaseException):
        pass

    def suite_handler(signum, frame):
        raise SuiteStopped(signum)

    old = signal.signal(signal.SIGTERM, suite_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        t0 = time.monotonic()
        if chain:
            with pytest.raises(SuiteStopped):
                run("import time; time.sleep(60)", nproc=2, chain_signals=True)
        else:
            rc, _, err, _ = run("import time; time.sleep(60)", nproc=2)
            assert rc == 128 + signal.SIGTERM and "got signal 15; stopping the ranks" in err
        assert time.monotonic() - t0 < 30  # the ranks were stopped, not waited for
        assert signal.getsignal(signal.SIGTERM) is suite_handler  # restored either way
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)


def test_end_reaps_a_rank_whose_popen_lock_a_signal_left_held():
    """A Stopped raised by the launcher's signal handler inside Popen.poll, after poll took the Popen's waitpid
    lock and before the code that releases it, leaves that lock held (seen under load: the launcher hung after
    SIGTERM with its ranks as zombies). procs.end must still kill and reap the rank: here the lock is taken as
    such a signal would leave it, and end() must return within its wait plus a margin, the leader reaped
    (a returncode, no zombie left)."""
    import os
    import signal
    import subprocess
    import threading

    from tsgen import procs

    proc = procs.start([PY, "-c", "import time; time.sleep(60)"], stop_signal=signal.SIGTERM)
    lock = getattr(proc, "_waitpid_lock", None)
    if lock is None:
        pytest.skip("this Python's Popen has no _waitpid_lock")
    assert lock.acquire(False), "the lock was free"
    done = threading.Event()
    worker = threading.Thread(target=lambda: (procs.end(proc), done.set()), daemon=True)
    t0 = time.monotonic()
    worker.start()
    try:
        assert done.wait(procs.REAP_WAIT_S + 10), "procs.end blocked on the Popen's waitpid lock"
    finally:
        lock.release()
    assert time.monotonic() - t0 < procs.REAP_WAIT_S + 10
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    assert proc.pid not in procs._live
    with pytest.raises(ChildProcessError):  # reaped: no zombie of it left
        os.waitpid(proc.pid, os.WNOHANG)
    subprocess.run([PY, "-c", "pass"], check=True)  # the interpreter's other children unaffected
