"""Rendezvous for one process per GPU: a key-value store shared by the ranks and
the two collective steps the IPC backend needs (all-gather, barrier).

The store is torch.distributed's TCPStore when torch imports (the default
process group's store if one is initialized), otherwise tsgen's own: a child
process of rank 0 serves a dict over TCP (store_server.py; a process, so that
rank 0 blocked in a C call holding the GIL cannot starve the others), and
every rank, rank 0 included, is a client. Both answer three requests -- set, get, check -- and
`Rendezvous` builds the collectives on them by polling `check`, so both
behave the same: every wait has a timeout that names the label of the step,
the ranks that never arrived and their keys; a rank that fails can `abort`
the rendezvous so the others stop waiting at once, with its message.

Collectives are numbered in the order a process calls them (keys
`tsgen/<number>/<rank>`): every rank must call the same collectives in the
same order, and each value carries its label so ranks out of step are
reported instead of exchanging the wrong data.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from ..errors import RuntimeSetupError
from .store_server import _recv, _send

DEFAULT_TIMEOUT = 300.0  # seconds; TSGEN_STORE_TIMEOUT overrides (torch's default is the same)
ABORT_KEY = "tsgen/abort"


class StoreError(RuntimeSetupError):
    """A rank did not arrive in time, the store could not be reached, or a peer gave up."""


def store_timeout(env=os.environ) -> float:
    text = env.get("TSGEN_STORE_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise StoreError(f"TSGEN_STORE_TIMEOUT={text!r}: give the store timeout in seconds (> 0)")
    return value


class KeyValue(Protocol):
    """What a rendezvous needs from a store: no call waits for a key."""

    where: str  # for messages: "tsgen store at 127.0.0.1:29500"

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...  # the key exists

    def check(self, keys: list[str]) -> bool: ...  # every key exists

    def close(self) -> None: ...


# ---------------------------------------------------------------------------
# tsgen's own store: a dict behind a socket, served by a child process of rank 0
# ---------------------------------------------------------------------------

class TcpStore:
    """tsgen's own store. `serve=True` (rank 0) also starts the server (store_server.py)
    as a child process, which ends when this store is closed or this process exits."""

    def __init__(self, host: str, port: int, serve: bool, timeout: float):
        self.where = f"tsgen store at {host}:{port}"
        self._server = None
        self._lock = threading.Lock()
        if serve:
            self._server = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("store_server.py")), host, str(port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            said = self._server.stdout.readline().strip()
            if said != "ready":
                self.close()
                raise StoreError(
                    f"rank 0 cannot serve the {self.where}: {said.removeprefix('error: ') or 'the server exited'}; "
                    "set MASTER_PORT to a free port (tsgen launch picks one)"
                ) from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=min(5.0, timeout))
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    self.close()
                    raise StoreError(
                        f"could not reach the {self.where} within {timeout:.0f} s ({e.strerror or e}); rank 0 "
                        "serves it: is rank 0 running, and do MASTER_ADDR / MASTER_PORT agree on every rank?"
                    ) from None
                time.sleep(0.05)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(timeout)

    def _request(self, tag: bytes, *parts: bytes) -> tuple[bytes, list[bytes]]:
        with self._lock:
            if self._sock is None:
                raise StoreError(f"the {self.where} was closed by this process")
            try:
                _send(self._sock, tag, *parts)
                return _recv(self._sock)
            except (ConnectionError, OSError) as e:
                raise StoreError(f"lost the connection to the {self.where} ({e}); did rank 0 exit?") from None

    def set(self, key: str, value: bytes) -> None:
        self._request(b"S", key.encode(), value)

    def get(self, key: str) -> bytes:
        tag, parts = self._request(b"G", key.encode())
        if tag != b"+":
            raise StoreError(f"key {key!r} is not in the {self.where}")
        return parts[0]

    def check(self, keys: list[str]) -> bool:
        return self._request(b"C", *(k.encode() for k in keys))[0] == b"+"

    def close(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
            self._sock = None
        if self._server is not None:
            server, self._server = self._server, None
            try:
                server.stdin.close()  # the server's cue to stop
                server.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                server.kill()
                server.wait()
            server.stdout.close()


class TorchStore:
    """torch.distributed's TCPStore (or the default process group's store) behind the same three calls."""

    def __init__(self, store, where: str):
        self.store, self.where = store, where

    @classmethod
    def connect(cls, host: str, port: int, serve: bool, timeout: float) -> "TorchStore":
        import datetime

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # torch already has a store on MASTER_PORT: share it (our keys start with tsgen/)
            return cls(dist.distributed_c10d._get_default_store(), "torch.distributed's default store")
        where = f"torch TCPStore at {host}:{port}"
        try:
            store = dist.TCPStore(host, port, is_master=serve, timeout=datetime.timedelta(seconds=timeout),
                                  wait_for_workers=False)
        except Exception as e:  # RuntimeError / DistNetworkError, message names the cause
            raise StoreError(f"{'serving' if serve else 'reaching'} the {where}: {e}") from None
        return cls(store, where)

    def _call(self, method: str, *args):
        try:
            return getattr(self.store, method)(*args)
        except Exception as e:  # torch raises RuntimeError / DistNetworkError / DistStoreError
            raise StoreError(f"the {self.where} failed ({e}); did the rank serving it exit?") from None

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def close(self) -> None:
        self.store = None


# ---------------------------------------------------------------------------
# Collectives over a store
# ---------------------------------------------------------------------------


class Rendezvous:
    """`size` ranks meeting through one store; this object is rank `rank`'s side."""

    def __init__(self, kv: KeyValue, rank: int, size: int, timeout: float = DEFAULT_TIMEOUT,
                 serves: bool = False, linger: float = 10.0):
        self.kv, self.rank, self.size, self.timeout = kv, rank, size, timeout
        self.serves, self.linger = serves, linger  # a serving rank waits for the others before closing
        self._seq = 0
        self.closed = False

    def all_gather(self, label: str, value: bytes = b"", timeout: float | None = None) -> list[bytes]:
        """Every rank's `value`, in rank order. `label` says what the step is for messages."""
        seq, self._seq = self._seq, self._seq + 1
        keys = [f"tsgen/{seq}/{r}" for r in range(self.size)]
        self.kv.set(keys[self.rank], label.encode() + b"\0" + value)
        self._wait(keys, label, self.timeout if timeout is None else timeout)
        out = []
        for r, key in enumerate(keys):
            theirs, _, data = self.kv.get(key).partition(b"\0")
            if theirs.decode() != label:
                why = self.aborted()  # a rank that failed went straight to its cleanup: say why
                if why is not None:
                    raise StoreError(f"rank {self.rank} gave up waiting in {label!r}: {why}")
                raise StoreError(
                    f"ranks out of step at collective #{seq}: rank {self.rank} is at {label!r}, "
                    f"rank {r} at {theirs.decode()!r} (every rank must make the same calls in the same order)"
                )
            out.append(data)
        return out

    def barrier(self, label: str, timeout: float | None = None) -> None:
        self.all_gather(label, b"", timeout)

    def abort(self, message: str) -> None:
        """Tell every rank waiting in (or later entering) a collective to give up."""
        try:
            self.kv.set(ABORT_KEY, f"rank {self.rank}: {message}".encode())
        except StoreError:
            pass  # the store is gone: the others time out instead

    def aborted(self) -> str | None:
        try:
            return self.kv.get(ABORT_KEY).decode() if self.kv.check([ABORT_KEY]) else None
        except StoreError:
            return None

    def _wait(self, keys: list[str], label: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 50e-6
        while not self.kv.check(keys):
            why = self.aborted()
            if why is not None:
                if self.kv.check(keys):  # the last key came before the abort: this collective is complete
                    return
                raise StoreError(f"rank {self.rank} gave up waiting in {label!r}: {why}")
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self.kv.check([k])]
                raise StoreError(
                    f"rank {self.rank} waited {timeout:g} s in {label!r} for rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} (key{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(keys[r] for r in missing)} in the {self.kv.where}); "
                    "did that rank exit, hang, or make different calls?"
                )
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def close(self) -> None:
        """Leave the rendezvous. The rank that serves the store keeps it up until every
        rank has left (at most `linger` s, none once a rank aborted)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.serves:
                deadline = time.monotonic() + self.linger
                left = [f"tsgen/left/{r}" for r in range(self.size) if r != self.rank]
                while not self.kv.check(left) and self.aborted() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            else:
                self.kv.set(f"tsgen/left/{self.rank}", b"")
        except StoreError:
            pass
        finally:
            self.kv.close()


def connect(host: str, port: int, rank: int, size: int, env=os.environ) -> Rendezvous:
    """A rendezvous on the store chosen by TSGEN_STORE: `torch` (torch.distributed's
    TCPStore), `tsgen` (tsgen's own), or unset/`auto` (torch when it imports)."""
    timeout = store_timeout(env)
    choice = env.get("TSGEN_STORE", "auto")
    if choice not in ("auto", "torch", "tsgen"):
        raise StoreError(f"TSGEN_STORE={choice!r}: choose torch, tsgen or auto")
    # under torchrun with TORCHELASTIC_USE_AGENT_STORE=True the agent serves MASTER_PORT
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent and choice == "tsgen":
        raise StoreError("TSGEN_STORE=tsgen under torchrun's agent store: MASTER_PORT is served by the torchrun "
                         "agent (a torch TCPStore); use TSGEN_STORE=torch or auto")
    serve = rank == 0 and not agent
    if choice != "tsgen":
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            if choice == "torch":
                raise StoreError("TSGEN_STORE=torch but torch.distributed does not import") from None
        else:
            kv = TorchStore.connect(host, port, serve, timeout)
            serve = serve and not kv.where.startswith("torch.distributed's default")
            return Rendezvous(kv, rank, size, timeout, serves=serve)
    return Rendezvous(TcpStore(host, port, serve, timeout), rank, size, timeout, serves=serve)


_shared: dict[tuple, Rendezvous] = {}


def shared(host: str, port: int, rank: int, size: int) -> Rendezvous:
    """This process's rendezvous (made once, reused by every World, left at exit):
    ranks that create and destroy Worlds in the same order stay in step. Once any rank
    has aborted, every later wait on it fails with that rank's message: the job is over."""
    key = (host, port, rank, size)
    rv = _shared.get(key)
    if rv is None or rv.closed:
        rv = _shared[key] = connect(host, port, rank, size)
        atexit.register(rv.close)
    return rv
