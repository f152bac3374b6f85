"""Rendezvous for one process per GPU: a key-value store shared by the ranks and
the two collective steps the IPC and NVSHMEM backends need (all-gather, barrier).

One `Rendezvous` (the collectives, abort and aborted) runs over any `KeyValue`
(set, get, check: no call waits), of which there are two: `TorchStore`, a
torch.distributed (c10d) store, and `TcpStore`, tsgen's own. Which store a
process meets its peers in is decided in one place, `store_choice` (TSGEN_STORE:
auto, torch or tsgen):
- **torch group**: torch.distributed has a default process group (gloo or nccl,
  however it was started): its store (`_get_default_store`, a PrefixStore of the
  TCPStore it was made on). Only store calls are made, no collective, so no GPU is needed.
- **torchrun agent**: the process was started by torchrun (TORCHELASTIC_USE_AGENT_STORE=True)
  and has no process group: torchrun's agent serves a TCPStore on MASTER_ADDR:MASTER_PORT
  (made anew for every restart attempt); every rank is a client of it.
- **tsgen**: tsgen's own store, for worlds started without torch (`tsgen launch`, or
  mpirun / srun with TSGEN_STORE_SECRET set): a child process of rank 0 serves a dict over
  TCP (store_server.py; a process, so that rank 0 blocked in a C call holding the GIL cannot
  starve the others), and every rank, rank 0 included, is a client. It serves only the job's
  ranks (each proves it knows the job's secret, TSGEN_STORE_SECRET, which `tsgen launch`
  gives every rank, and the server proves it back) and only on a loopback address unless
  TSGEN_STORE_REMOTE=1.
- **torch TCPStore**: only when asked (TSGEN_STORE=torch) with neither of the first two: a
  torch TCPStore on MASTER_ADDR:MASTER_PORT served by rank 0, which authenticates no one.

`Rendezvous` builds the collectives on `check` by polling, so every store behaves the
same: every wait has a timeout that names the label of the step, the ranks that never
arrived and their keys; a rank that fails can `abort` the rendezvous so the others stop
waiting at once (within a poll, at most 1 ms), with its message.

Collectives are numbered in the order a process calls them (keys
`tsgen/<number>/<rank>`): every rank must call the same collectives in the
same order, and each value carries its label so ranks out of step are
reported instead of exchanging the wrong data.
"""

from __future__ import annotations

import atexit
import hmac
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from ..env import STORE_SECRET, env_seconds
from ..errors import RuntimeSetupError
from .store_server import MAX_PART, NONCE, Malformed, _recv, _send, proof

DEFAULT_TIMEOUT = 300.0  # seconds; TSGEN_STORE_TIMEOUT overrides (torch's default is the same)
JOINED_KEY = "tsgen/joined"  # a counter every rendezvous on a torch store adds 1 to: its generation


class StoreError(RuntimeSetupError):
    """A rank did not arrive in time, the store could not be reached, or a peer gave up."""


def store_timeout(env=os.environ) -> float:
    return env_seconds("TSGEN_STORE_TIMEOUT", str(DEFAULT_TIMEOUT), StoreError, env)


def _secret(env) -> bytes:
    secret = env.get(STORE_SECRET, "").strip()  # the server reads it as a line
    if not secret:
        raise StoreError(f"tsgen's store serves only the ranks of one job, which share a secret in {STORE_SECRET}: "
                         "`tsgen launch` sets it for every rank; under another launcher set it to the same random "
                         "value in every rank (python -c 'import secrets; print(secrets.token_hex(32))'); or start the ranks "
                         "with torchrun, or initialize a torch.distributed process group before the first World, "
                         "and they meet in torch's store")
    return secret.encode()


def _loopback(host: str) -> bool:
    """Every address `host` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


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
    as a child process, which ends when this store is closed or this process exits.
    `secret`: the job's (TSGEN_STORE_SECRET); `remote`: serve on an address that is not
    loopback (TSGEN_STORE_REMOTE=1)."""

    def __init__(self, host: str, port: int, serve: bool, timeout: float, secret: bytes, remote: bool = False):
        self.where = f"tsgen store at {host}:{port}"
        self._server = None
        self._sock = None
        self._lock = threading.Lock()
        self._secret = secret
        if serve and not remote and not _loopback(host):
            raise StoreError(f"rank 0 serves the {self.where} on loopback addresses only, and MASTER_ADDR={host} is "
                             "not one: set MASTER_ADDR=127.0.0.1 (ranks on this host), or TSGEN_STORE_REMOTE=1 to "
                             "serve it there (every request still needs the job's secret, but values travel "
                             "unencrypted), or use torch's store (TSGEN_STORE=torch)")
        if serve:
            self._server = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("store_server.py")), host, str(port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._server.stdin.write(secret.decode() + "\n")
            self._server.stdin.flush()
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
                sock = socket.create_connection((host, port), timeout=min(5.0, timeout))
                try:
                    self._handshake(sock)
                except BaseException:
                    sock.close()
                    raise
                self._sock = sock
                break
            except StoreError:
                self.close()
                raise
            except OSError as e:  # not listening yet, or the server had no room: try again
                if time.monotonic() >= deadline:
                    self.close()
                    raise StoreError(
                        f"could not reach the {self.where} within {timeout:.0f} s ({e.strerror or e}); rank 0 "
                        "serves it: is rank 0 running, and do MASTER_ADDR / MASTER_PORT agree on every rank?"
                    ) from None
                time.sleep(0.05)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(timeout)

    def _handshake(self, sock: socket.socket) -> None:
        """Prove this rank knows the job's secret, and have the server prove it does too (a rank
        hands its values to no one else); StoreError when either proof fails."""
        try:
            tag, parts = _recv(sock, max_parts=1, max_part=256)
            if tag != b"N" or len(parts) != 1 or len(parts[0]) != NONCE:
                raise Malformed("it did not open with a tsgen store's challenge")
            server_nonce, mine = parts[0], os.urandom(NONCE)
            _send(sock, b"A", mine, proof(self._secret, b"client", server_nonce, mine))
            tag, parts = _recv(sock, max_parts=1, max_part=256)
        except Malformed as e:
            raise StoreError(f"the process serving the {self.where} is not a tsgen store ({e})") from None
        if tag == b"!":
            raise StoreError(f"the {self.where} refused this rank: {parts[0].decode(errors='replace') if parts else ''}")
        if tag != b"+" or len(parts) != 1 or not hmac.compare_digest(
                parts[0], proof(self._secret, b"server", server_nonce, mine)):
            raise StoreError(f"the process serving the {self.where} does not know this job's secret "
                             f"({STORE_SECRET}): another job's store, or a stranger on the port")

    def _request(self, tag: bytes, *parts: bytes) -> tuple[bytes, list[bytes]]:
        with self._lock:
            if self._sock is None:
                raise StoreError(f"the {self.where} was closed by this process")
            try:
                _send(self._sock, tag, *parts)
                reply = _recv(self._sock)
            except (ConnectionError, OSError, Malformed) as e:
                raise StoreError(f"lost the connection to the {self.where} ({e}); did rank 0 exit?") from None
        if reply[0] == b"!":
            raise StoreError(f"the {self.where} refused a request: {b''.join(reply[1]).decode(errors='replace')}")
        return reply

    def set(self, key: str, value: bytes) -> None:
        if len(value) > MAX_PART:
            raise StoreError(f"a value of {len(value)} bytes for key {key!r}: the {self.where} takes at most "
                             f"{MAX_PART} bytes per value")
        self._request(b"S", key.encode(), value)

    def get(self, key: str) -> bytes:
        tag, parts = self._request(b"G", key.encode())
        if tag != b"+":
            raise StoreError(f"key {key!r} is not in the {self.where}")
        return parts[0]

    def check(self, keys: list[str]) -> bool:
        return self._request(b"C", *(k.encode() for k in keys))[0] == b"+"

    def close(self) -> None:
        sock = self._sock
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
    """A torch.distributed (c10d) store behind the same three calls: the default process
    group's (`of_group`), torchrun's agent's or a TCPStore of tsgen's making (`tcp`)."""

    def __init__(self, store, where: str, group: object | None = None):
        self.store, self.where = store, where
        self.group = group  # the default process group's store object, when that is the store

    @classmethod
    def of_group(cls) -> "TorchStore":
        """The default process group's store: the one its ranks met in (no collective is run)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise StoreError("torch.distributed has no default process group: call "
                             "torch.distributed.init_process_group first")
        store = dist.distributed_c10d._get_default_store()
        return cls(store, "torch.distributed's default store", group=store)

    @classmethod
    def tcp(cls, host: str, port: int, serve: bool, timeout: float, where: str | None = None) -> "TorchStore":
        """A TCPStore on host:port: served by this process when `serve`, else a client of it."""
        import datetime

        import torch.distributed as dist

        where = where or f"torch TCPStore at {host}:{port}"
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
            raise StoreError(f"the {self.where} failed ({e}); did the process serving it exit?") from None

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def add(self, key: str, amount: int) -> int:
        """The counter at `key` after adding `amount` (atomic in the store)."""
        return int(self._call("add", key, amount))

    def close(self) -> None:
        self.store = None


# ---------------------------------------------------------------------------
# Collectives over a store
# ---------------------------------------------------------------------------


class Rendezvous:
    """`size` ranks meeting through one store; this object is rank `rank`'s side."""

    def __init__(self, kv: KeyValue, rank: int, size: int, timeout: float = DEFAULT_TIMEOUT,
                 serves: bool = False, linger: float = 10.0, rank_serves: bool = True):
        self.kv, self.rank, self.size, self.timeout = kv, rank, size, timeout
        self.serves, self.linger = serves, linger  # a serving rank waits for the others before closing
        # some rank serves the store and waits for the others to leave (else torch serves it: the
        # process group's or torchrun's store, and no rank needs to hear who left)
        self.rank_serves = rank_serves
        self.space = f"tsgen/{self.generation(kv, size)}"  # every key of this rendezvous starts with it
        self._seq = 0
        self.closed = False

    @staticmethod
    def generation(kv: KeyValue, size: int) -> int:
        """Which rendezvous on this store this is: 0 on a store of its own (tsgen's, a TCPStore of
        tsgen's making); on a torch store that outlives a process group (a group destroyed and
        made again over the same store and prefix, e.g. torchrun's agent's), every rank of every
        rendezvous adds 1 to one counter, so the n-th rendezvous of `size` ranks reads a sum in
        (n size, (n + 1) size] whatever the ranks' order, and its keys never meet an earlier
        one's (stale values, an old abort)."""
        add = getattr(kv, "add", None)
        return 0 if add is None else (add(JOINED_KEY, 1) - 1) // size

    def all_gather(self, label: str, value: bytes = b"", timeout: float | None = None) -> list[bytes]:
        """Every rank's `value`, in rank order. `label` says what the step is for messages."""
        seq, self._seq = self._seq, self._seq + 1
        keys = [f"{self.space}/{seq}/{r}" for r in range(self.size)]
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
            self.kv.set(f"{self.space}/abort", f"rank {self.rank}: {message}".encode())
        except StoreError:
            pass  # the store is gone: the others time out instead

    def aborted(self) -> str | None:
        try:
            key = f"{self.space}/abort"
            return self.kv.get(key).decode() if self.kv.check([key]) else None
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
                left = [f"{self.space}/left/{r}" for r in range(self.size) if r != self.rank]
                while not self.kv.check(left) and self.aborted() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            elif self.rank_serves:
                self.kv.set(f"{self.space}/left/{self.rank}", b"")
        except StoreError:
            pass
        finally:
            self.kv.close()


def store_choice(env, torch_group: bool) -> str:
    """Which store this process meets its peers in ("torch group", "torchrun agent", "tsgen" or
    "torch TCPStore", the module doc says what each is), from TSGEN_STORE and
    whether torch.distributed has a default process group (`torch_group`). Pure.

    auto (unset): the process group's store when there is one, else torchrun's agent's when
    torchrun started the process, else tsgen's (which needs TSGEN_STORE_SECRET: `tsgen launch`
    sets it). torch: the same two torch stores, else a TCPStore rank 0 serves. tsgen: tsgen's."""
    choice = env.get("TSGEN_STORE", "auto")
    if choice not in ("auto", "torch", "tsgen"):
        raise StoreError(f"TSGEN_STORE={choice!r}: choose torch, tsgen or auto")
    # torchrun (TORCHELASTIC_USE_AGENT_STORE=True): its agent serves MASTER_PORT
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if choice == "tsgen":
        if agent:
            raise StoreError("TSGEN_STORE=tsgen under torchrun's agent store: MASTER_PORT is served by the torchrun "
                             "agent (a torch TCPStore); use TSGEN_STORE=torch or auto")
        return "tsgen"
    if torch_group:
        return "torch group"
    if agent:
        return "torchrun agent"
    return "torch TCPStore" if choice == "torch" else "tsgen"


def connect(host: str, port: int, rank: int, size: int, env=os.environ) -> Rendezvous:
    """This rank's side of a rendezvous on the store `store_choice` picks (host and port:
    MASTER_ADDR / MASTER_PORT, where a store is reached or served)."""
    timeout = store_timeout(env)
    kind = store_choice(env, _torch_initialized())
    if kind == "tsgen":
        serve = rank == 0
        store = TcpStore(host, port, serve, timeout, _secret(env), remote=env.get("TSGEN_STORE_REMOTE") == "1")
        return Rendezvous(store, rank, size, timeout, serves=serve)
    try:
        import torch.distributed  # noqa: F401
    except ImportError as e:
        why = {"torchrun agent": "torchrun started this process, and its agent's store is torch's",
               "torch TCPStore": "TSGEN_STORE=torch"}.get(kind, kind)
        raise StoreError(f"{why}, but torch.distributed does not import in this Python ({e})") from None
    # the group's or torchrun's store: torch serves it, rank 0 exits when it likes (a rank telling
    # a store whose server has gone that it left would fail, and torch would print a stack)
    if kind == "torch group":
        return Rendezvous(TorchStore.of_group(), rank, size, timeout, rank_serves=False)
    if kind == "torchrun agent":
        kv = TorchStore.tcp(host, port, False, timeout, where=f"torchrun agent's store at {host}:{port}")
        return Rendezvous(kv, rank, size, timeout, rank_serves=False)
    return Rendezvous(TorchStore.tcp(host, port, rank == 0, timeout), rank, size, timeout, serves=rank == 0)


def torch_group() -> tuple[int, int] | None:
    """(rank, world size) of torch.distributed's default process group when torch is imported
    already and has one initialized, else None (torch is never imported here: tsgen runs
    without it)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 -- a half-imported torch
        return None


def _torch_initialized() -> bool:
    return torch_group() is not None


_shared: dict[tuple, Rendezvous] = {}


def _group_store() -> object | None:
    """The default process group's store object while torch.distributed has one, else None."""
    if torch_group() is None:
        return None
    try:
        return sys.modules["torch.distributed"].distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 -- the group went away meanwhile
        return None


def shared(host: str, port: int, rank: int, size: int) -> Rendezvous:
    """This process's rendezvous (made once, reused by every World, left at exit):
    ranks that create and destroy Worlds in the same order stay in step. Once any rank
    has aborted, every later wait on it fails with that rank's message: the job is over.
    A process group destroyed and made again is a new store: the rendezvous on the old one
    is dropped (not left: its store may be gone) and a new one made."""
    key = (host, port, rank, size)
    rv = _shared.get(key)
    group = _group_store()
    if rv is not None and not rv.closed and isinstance(rv.kv, TorchStore) and rv.kv.group is not None \
            and rv.kv.group is not group:
        atexit.unregister(rv.close)
        rv.closed = True
        rv = None
    if rv is None or rv.closed:
        rv = _shared[key] = connect(host, port, rank, size)
        atexit.register(rv.close)
    return rv
