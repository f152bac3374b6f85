"""`tsgen launch --nproc N -- CMD...`: one process per GPU on this host.

Starts N copies of CMD with the environment torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), forwards every
line they print prefixed with `[rank K]`, and when one rank fails gives the
others `grace` seconds to end on their own -- a kernel waiting for the failed
rank times out and prints what it waited for -- then ends the rest, prints
every rank's exit code and returns the failed rank's, so a crash is never a
hang.
NVLink multicast stays off in every child (tsgen/env.py's variables, forced).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence, TextIO

from .env import force_no_multicast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
    )
    force_no_multicast(env)  # forced, not defaulted: multicast is never on in a child
    return env


def _pump(stream, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live rank's process group, then SIGKILL what is left after `grace` s."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        left = max(0.0, deadline - time.monotonic())
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _code(c: int) -> int:
    return 128 - c if c < 0 else c  # killed by signal -c


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_on_signals():
    """Turn SIGTERM, SIGINT and SIGHUP into _Stopped (so `finally` stops the ranks); returns
    what puts the old handlers back. Only the main thread may set handlers: elsewhere nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise _Stopped(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    return lambda: [signal.signal(s, h) for s, h in old.items()]


def launch(cmd: Sequence[str], nproc: int, port: int | None = None, grace: float = 30.0,
           timeout: float | None = None, out: TextIO | None = None, err: TextIO | None = None,
           kill_after: float = 5.0, env: dict | None = None) -> int:
    """Run `cmd` as `nproc` ranks; 0 when all succeed, else the first failing rank's code
    (128 + signal number for a rank killed by a signal, 124 on timeout). After a failure
    the others get `grace` s to end on their own, then SIGTERM, then SIGKILL after
    `kill_after` s. `env`: the ranks' base environment (default this process's)."""
    if nproc < 1:
        raise ValueError("--nproc must be at least 1")
    if not cmd:
        raise ValueError("nothing to launch: give the command after --")
    out, err = out or sys.stdout, err or sys.stderr
    port = port or free_port()
    # A signal to the launcher (timeout(1), Ctrl-C, a job scheduler) must reach the ranks too:
    # they run in sessions of their own, so without this they would outlive it.
    stopped = _raise_on_signals()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for rank in range(nproc):
            try:
                p = subprocess.Popen(list(cmd), env=rank_env(rank, nproc, port, env), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
            except OSError as e:  # no such program, not executable, ...
                raise ValueError(f"cannot start {cmd[0]!r}: {e.strerror}") from None
            procs.append(p)
            for stream, sink in ((p.stdout, out), (p.stderr, err)):
                t = threading.Thread(target=_pump, args=(stream, f"[rank {rank}] ", sink, lock), daemon=True)
                t.start()
                pumps.append(t)
        start = time.monotonic()
        code, failed_at = 0, None
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and failed_at is None:
                rank, c = failed[0]
                code, failed_at = _code(c), time.monotonic()
                with lock:
                    err.write(f"tsgen launch: rank {rank} exited with {code}; the other ranks get "
                              f"{grace:g} s to end on their own\n")
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > grace:
                with lock:
                    err.write(f"tsgen launch: stopping the ranks still running {grace:g} s after rank {rank} "
                              "failed\n")
                break
            if timeout is not None and time.monotonic() - start > timeout:
                code = code or 124
                with lock:
                    err.write(f"tsgen launch: ranks still running after {timeout:g} s; stopping them\n")
                break
            time.sleep(0.05)
    except _Stopped as e:
        code = 128 + e.signum
        with lock:
            err.write(f"tsgen launch: got signal {e.signum}; stopping the ranks\n")
    finally:
        _stop(procs, kill_after)
        for t in pumps:
            t.join(timeout=2)
        stopped()
    if code:
        summary = ", ".join(f"rank {r}: {_code(p.returncode)}" for r, p in enumerate(procs))
        err.write(f"tsgen launch: exit codes: {summary}\n")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tsgen.launch --nproc N [--port P] [--timeout S] -- CMD...`"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tsgen.launch", description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    try:
        return launch(cmd, a.nproc, port=a.port, timeout=a.timeout, grace=a.grace)
    except ValueError as e:
        print(f"tsgen launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
