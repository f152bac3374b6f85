"""The processes tsgen starts (the launcher's ranks, the compiler's nvcc and cuobjdump runs):
each in a session, so a process group, of its own, ended as a whole group.

A tool or a rank starts helpers of its own (nvcc: cicc, ptxas, the host compiler; a rank: the
store server, a data loader); killing the one process tsgen started would leave them running.
So every start goes through `start`, which registers the group, and `end` kills the whole
group (its leader may have exited already, its children not) and forgets it. While
`stop_on_signals` is active (the CLI's commands, `tsgen launch`), SIGTERM, SIGINT and SIGHUP
first signal every registered group (each with the signal it was registered with: SIGKILL for
a tool, SIGTERM for a rank, which gets time to end on its own) and then raise `Stopped` in the
main thread; at interpreter exit every group still registered is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading

# pid of the group's leader -> (its Popen, the signal that stops the group)
_live: dict[int, tuple[subprocess.Popen, int]] = {}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def start(cmd: list[str], stop_signal: int = signal.SIGKILL, **popen) -> subprocess.Popen:
    """Popen `cmd` in a new session (its own process group), registered until `end`. OSError
    as Popen raises it."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    _live[proc.pid] = (proc, stop_signal)
    return proc


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to every process of `proc`'s group; nothing if the group is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


REAP_WAIT_S = 5.0  # how long `end` waits through Popen for a SIGKILLed leader before reaping it itself


def end(proc: subprocess.Popen) -> None:
    """Kill `proc`'s whole group (SIGKILL), reap its leader and forget it."""
    signal_group(proc, signal.SIGKILL)
    reap(proc)
    _live.pop(proc.pid, None)


def reap(proc: subprocess.Popen, wait_s: float = REAP_WAIT_S) -> None:
    """Reap `proc` (killed, or about to end): Popen.wait with a timeout, then os.waitpid directly. Not a
    plain Popen.wait(): Stopped, raised by stop_on_signals' handler wherever the main thread is, can land
    inside Popen.poll just after it took the Popen's waitpid lock and before the code that releases it (the
    launcher's watch loop polls every rank every 50 ms), and a wait() without a timeout then blocks on that
    lock for ever (seen under load on 2026-11-28: the launcher hung after SIGTERM, its ranks left as
    zombies). A wait with a timeout only tries the lock, so it returns."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc.wait(timeout=wait_s)
    if proc.returncode is None:
        with contextlib.suppress(OSError):  # ChildProcessError: reaped already
            _, status = os.waitpid(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)


def _signal_all() -> None:
    for proc, sig in list(_live.values()):  # list() of a dict view: one step under the GIL
        signal_group(proc, sig)


@atexit.register
def _end_all() -> None:
    for proc, _ in list(_live.values()):
        end(proc)


class Stopped(Exception):
    """tsgen got SIGTERM, SIGINT or SIGHUP; every group it had started was signalled."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals(chain: bool = False):
    """While in this block: SIGTERM, SIGINT and SIGHUP signal every registered group, then
    raise Stopped (so `finally` blocks run and the caller exits 128 + the signal). Only the
    main thread may set handlers: elsewhere this does nothing. chain: on leaving the block
    after a signal, the handler in place before it gets that signal too (a suite's, which
    stops the suite and keeps what it finished), where it is a Python function."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def handler(signum, frame):
        caught.append(signum)
        _signal_all()
        raise Stopped(signum)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if chain and caught and callable(old[caught[0]]):
            old[caught[0]](caught[0], None)
