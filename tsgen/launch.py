"""`tsgen launch --nproc N -- CMD...`: one process per GPU on this host.

Starts N copies of CMD with the environment torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and a secret of this job
for the rendezvous store (TSGEN_STORE_SECRET), forwards every line they print
prefixed with `[rank K]`, and when one rank fails gives the others `grace`
seconds to end on their own -- a kernel waiting for the failed rank times out
and prints what it waited for -- then ends the rest, prints every rank's exit
code and returns the failed rank's, so a crash is never a hang.

Every rank runs in a process group of its own (tsgen/procs.py): what a rank
started is ended with it, when the rank exits and again when the launch ends.
Output is forwarded as bytes (nothing to encode, so nothing fails to), in pieces
of at most CHUNK bytes, each with its rank's prefix (a rank's 512 MiB line costs
the launcher 64 KiB, not gigabytes), and all of it before the launcher returns.
When the launcher's own output goes away (`tsgen launch ... | head`), it stops
the ranks and exits 141, as a program killed by SIGPIPE does.
NVLink multicast stays off in every child (tsgen/env.py's variables, forced).

tsgen's own launcher, kept beside torchrun rather than wrapping it: tsgen runs without torch,
and torchrun stops the other ranks at once after a failure (no time for their timeout
diagnosis) and exits 1 instead of the failed rank's code. Under torchrun the ranks meet in
torch's store instead of tsgen's (docs/design/runtime.md, "Starting the processes").
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Sequence, TextIO

from . import procs
from .env import STORE_SECRET, force_no_multicast, seconds_problem

CHUNK = 1 << 16  # the most bytes of one rank's line the launcher holds before forwarding them
EPIPE_CODE = 128 + signal.SIGPIPE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict | None = None, secret: str | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
    )
    if secret is not None:
        env[STORE_SECRET] = secret
    force_no_multicast(env)  # forced, not defaulted: multicast is never on in a child
    return env


class _Sink:
    """One output of the launcher (its stdout or its stderr), shared by the ranks' pumps under one
    lock. Bytes go to the stream's binary buffer as they came (a text stream without one, such
    as StringIO, gets them decoded with errors='replace'); once the reader is gone (EPIPE, a
    closed stream) every later write is dropped and `broken` is set."""

    def __init__(self, stream: TextIO, lock: threading.Lock):
        self.stream, self.lock, self.broken = stream, lock, False
        self.binary: BinaryIO | None = getattr(stream, "buffer", None)

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                if self.binary is not None:
                    self.stream.flush()  # text written before comes first
                    self.binary.write(data)
                    self.binary.flush()
                else:
                    self.stream.write(data.decode(errors="replace"))
                    self.stream.flush()
            except (OSError, ValueError):  # EPIPE, a closed stream
                self.broken = True

    def say(self, text: str) -> None:
        """A line of the launcher's own."""
        self.write(f"tsgen launch: {text}\n".encode())

    def quiet_at_exit(self) -> None:
        """After EPIPE: point the stream's descriptor at /dev/null, so the interpreter's last
        flush does not print a BrokenPipeError."""
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):
            return
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


class _Pump(threading.Thread):
    """Forwards one rank's stdout or stderr to a sink: line by line with the rank's prefix, a line
    longer than CHUNK in prefixed pieces of CHUNK bytes, a last line without a newline with one
    added. Reads to the end even after the sink broke: a rank must never block on a full pipe."""

    def __init__(self, stream: BinaryIO, prefix: str, sink: _Sink):
        super().__init__(daemon=True)
        self.stream, self.prefix, self.sink = stream, prefix.encode(), sink
        self.last = time.monotonic()  # when it last moved data

    def run(self) -> None:
        fd, pending = self.stream.fileno(), b""
        try:
            while data := os.read(fd, CHUNK):
                self.last = time.monotonic()
                *lines, pending = (pending + data).split(b"\n")
                while len(pending) >= CHUNK:
                    lines.append(pending[:CHUNK])
                    pending = pending[CHUNK:]
                if lines:
                    self.sink.write(b"".join(self.prefix + line + b"\n" for line in lines))
                    self.last = time.monotonic()
        except OSError:
            pass
        finally:
            if pending:
                self.sink.write(self.prefix + pending + b"\n")
            self.stream.close()

    def finish(self, idle: float) -> None:
        """Wait until the rank's stream has ended; give up only once no data moved for `idle` s
        (a process that left the rank's group still holds the pipe)."""
        while self.is_alive():
            self.join(timeout=0.1)
            if time.monotonic() - self.last > idle:
                return


def _stop(ranks: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live rank's group, SIGKILL each group (whatever is left of it, its leader
    exited or not) after `grace` s."""
    for p in ranks:
        if p.poll() is None:
            procs.signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in ranks:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        procs.end(p)


def _code(c: int) -> int:
    return 128 - c if c < 0 else c  # killed by signal -c


def check_arguments(nproc: int, port: int | None, timeout: float | None, grace: float, kill_after: float) -> None:
    """ValueError (a usage error: exit 2) for arguments no launch can use."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be at least 1")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"--port {port}: a TCP port is 1-65535 (leave it out for a free one)")
    for name, value, zero in (("--timeout", timeout, False), ("--grace", grace, True),
                              ("kill_after", kill_after, True)):
        problem = None if value is None else seconds_problem(value, zero)
        if problem:
            raise ValueError(f"{name} {value}: {problem}")


def launch(cmd: Sequence[str], nproc: int, port: int | None = None, grace: float = 30.0,
           timeout: float | None = None, out: TextIO | None = None, err: TextIO | None = None,
           kill_after: float = 5.0, env: dict | None = None, chain_signals: bool = False) -> int:
    """Run `cmd` as `nproc` ranks; 0 when all succeed, else the first failing rank's code
    (128 + signal number for a rank killed by a signal, 124 on timeout, 141 when the
    launcher's output was closed). After a failure the others get `grace` s to end on
    their own, then SIGTERM, then SIGKILL after `kill_after` s. `env`: the ranks' base
    environment (default this process's). A signal to the launcher stops the ranks and returns
    128 + its number; with chain_signals, once they are stopped the caller's own handler for it
    runs too (procs.stop_on_signals(chain=True)): a bench suite stops, not one baseline."""
    check_arguments(nproc, port, timeout, grace, kill_after)
    if not cmd:
        raise ValueError("nothing to launch: give the command after --")
    lock = threading.Lock()
    sinks = out_sink, err_sink = _Sink(out or sys.stdout, lock), _Sink(err or sys.stderr, lock)
    port = port or free_port()
    secret = secrets.token_hex(32)  # this job's: every rank gets it, no other process does
    ranks: list[subprocess.Popen] = []
    pumps: list[_Pump] = []
    code = 0
    # A signal to the launcher (timeout(1), Ctrl-C, a job scheduler) must reach the ranks too:
    # they run in sessions of their own, so without this they would outlive it.
    with procs.stop_on_signals(chain=chain_signals):
        try:
            for rank in range(nproc):
                try:
                    p = procs.start(list(cmd), stop_signal=signal.SIGTERM, env=rank_env(rank, nproc, port, env, secret),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                except OSError as e:  # no such program, not executable, ...
                    raise ValueError(f"cannot start {cmd[0]!r}: {e.strerror}") from None
                ranks.append(p)
                for stream, sink in ((p.stdout, out_sink), (p.stderr, err_sink)):
                    pumps.append(_Pump(stream, f"[rank {rank}] ", sink))
                    pumps[-1].start()
            code = _watch(ranks, sinks, grace, timeout)
        except procs.Stopped as e:
            code = 128 + e.signum
            err_sink.say(f"got signal {e.signum}; stopping the ranks")
        finally:
            _stop(ranks, kill_after)
            for t in pumps:
                t.finish(idle=max(kill_after, 1.0))
    if code and code != EPIPE_CODE:
        summary = ", ".join(f"rank {r}: {_code(p.returncode)}" for r, p in enumerate(ranks))
        err_sink.say(f"exit codes: {summary}")
    for sink in sinks:
        if sink.broken:
            sink.quiet_at_exit()
    return code


def _watch(ranks: list[subprocess.Popen], sinks: tuple[_Sink, _Sink], grace: float, timeout: float | None) -> int:
    """Wait for the ranks: 0 when all succeeded, else the first failure's code; returns early (the
    caller stops the rest) `grace` s after a failure, at `timeout`, or when an output broke.
    A rank's group is signalled as soon as the rank exits: what it left running goes with it."""
    err = sinks[1]
    start = time.monotonic()
    code, failed_at, ended = 0, None, set()
    while True:
        codes = [p.poll() for p in ranks]
        for r, c in enumerate(codes):
            if c is not None and r not in ended:
                ended.add(r)
                procs.signal_group(ranks[r], signal.SIGTERM)
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and failed_at is None:
            rank, c = failed[0]
            code, failed_at = _code(c), time.monotonic()
            err.say(f"rank {rank} exited with {code}; the other ranks get {grace:g} s to end on their own")
        if all(c is not None for c in codes):
            return code
        if any(s.broken for s in sinks):
            return code or EPIPE_CODE
        if failed_at is not None and time.monotonic() - failed_at > grace:
            err.say(f"stopping the ranks still running {grace:g} s after rank {rank} failed")
            return code
        if timeout is not None and time.monotonic() - start > timeout:
            err.say(f"ranks still running after {timeout:g} s; stopping them")
            return code or 124
        time.sleep(0.05)


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
