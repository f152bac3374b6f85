"""tsgen's own store server: a dict behind a socket, in a process of its own.

Rank 0 of a world using tsgen's store (tsgen.runtime.store.TcpStore) starts this
file as a child process: `python store_server.py HOST PORT`, then writes the job's
secret as the first line of its stdin. It binds, prints `ready` (or `error: why`) on
stdout, serves until its stdin closes (rank 0 left or died), then exits. Serving from
a thread of rank 0 instead starved the other ranks whenever rank 0 sat in a C call
that holds the GIL (measured: nvshmem4py's nvshmem_free waiting for a rank that was
itself waiting for the store). Standard library only, so it runs by path without
tsgen on sys.path.

Only the job's ranks are served: a new connection gets a random challenge and must
answer with an HMAC of it under the job's secret (TSGEN_STORE_SECRET, which `tsgen
launch` gives every rank) within AUTH_TIMEOUT s; the server then proves it knows the
secret too, so a rank never hands its values to a stranger on the port. Everything is
bounded: MAX_CLIENTS connections at once, MAX_PART bytes per key or value, MAX_PARTS
keys per request, AUTH_TIMEOUT s for the whole authentication and MESSAGE_TIMEOUT s for
a request that has begun to arrive in full, however slowly its bytes trickle in.
A request that breaks the protocol is answered `!` with what was wrong, and the
connection closed; nothing is printed.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import socket
import socketserver
import struct
import sys
import threading
import time

# A message is a tag byte, a count, and that many length-prefixed byte strings.
# Handshake: server b"N" (nonce); client b"A" (nonce, proof); server b"+" (proof) or b"!" (why).
# Requests: b"S" (key, value), b"G" (key), b"C" (keys...); replies: b"+" (values...),
# b"-" (a key is missing) or b"!" (the request was refused: why; the connection closes).

_COUNT = struct.Struct("!I")
MAX_PART = 16 << 20  # bytes of one key or value
MAX_PARTS = 1024  # strings in one message (the keys of one check)
MAX_CLIENTS = 64  # connections at once, authenticated or not (a rank holds one)
AUTH_TIMEOUT = 5.0  # seconds a new connection has to authenticate
MESSAGE_TIMEOUT = 60.0  # seconds a message may take to arrive once its first byte has
NONCE = 32


class Malformed(ValueError):
    """A message that breaks the protocol or its bounds."""


def proof(secret: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What `side` (b"client" or b"server") sends to show it knows the job's secret."""
    return hmac.new(secret, b"tsgen store 1\0" + side + b"\0" + server_nonce + client_nonce, hashlib.sha256).digest()


def _send(sock: socket.socket, tag: bytes, *parts: bytes) -> None:
    sock.sendall(tag + _COUNT.pack(len(parts)) + b"".join(_COUNT.pack(len(p)) + p for p in parts))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; socket.timeout once `deadline` (time.monotonic) passes, however the bytes trickle in."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            if deadline <= time.monotonic():
                raise socket.timeout("the message did not arrive in time")
            sock.settimeout(deadline - time.monotonic())
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, max_parts: int = MAX_PARTS, max_part: int = MAX_PART,
          deadline: float | None = None, within: float | None = None) -> tuple[bytes, list[bytes]]:
    """One message; Malformed past the bounds. `deadline` (time.monotonic): the whole message by
    then; `within`: once its first byte is in, the rest within this many seconds. Without either,
    the socket's own timeout applies to each read."""
    first = _recv_exact(sock, 1, deadline)
    if within is not None:
        deadline = min(deadline or math.inf, time.monotonic() + within)
    head = first + _recv_exact(sock, _COUNT.size, deadline)
    tag, (count,) = head[:1], _COUNT.unpack(head[1:])
    if count > max_parts:
        raise Malformed(f"{count} strings in one message; at most {max_parts}")
    parts = []
    for _ in range(count):
        (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size, deadline))
        if n > max_part:
            raise Malformed(f"a string of {n} bytes; at most {max_part}")
        parts.append(_recv_exact(sock, n, deadline))
    return tag, parts


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self._authenticated(sock):
                self._serve(sock)
        except Malformed as e:
            try:
                sock.settimeout(AUTH_TIMEOUT)
                _send(sock, b"!", str(e).encode())
            except OSError:
                pass
        except (OSError, ValueError):  # the client went away, timed out, or sent what no rank sends
            pass

    def _authenticated(self, sock: socket.socket) -> bool:
        nonce, deadline = os.urandom(NONCE), time.monotonic() + AUTH_TIMEOUT
        sock.settimeout(AUTH_TIMEOUT)
        _send(sock, b"N", nonce)
        tag, parts = _recv(sock, max_parts=2, max_part=64, deadline=deadline)
        if tag != b"A" or len(parts) != 2 or len(parts[0]) != NONCE:
            raise Malformed("not a tsgen store client (expected its authentication first)")
        if not hmac.compare_digest(parts[1], proof(self.server.secret, b"client", nonce, parts[0])):
            raise Malformed("authentication failed: this client does not know the job's secret (TSGEN_STORE_SECRET)")
        _send(sock, b"+", proof(self.server.secret, b"server", nonce, parts[0]))
        return True

    def _serve(self, sock: socket.socket) -> None:
        data, lock = self.server.data, self.server.lock
        while True:
            sock.settimeout(None)  # a rank may be quiet between collectives for as long as it likes
            tag, parts = _recv(sock, within=MESSAGE_TIMEOUT)
            try:
                keys = [p.decode() for p in (parts[:1] if tag == b"S" else parts)]
            except UnicodeDecodeError:
                raise Malformed("a key that is not UTF-8") from None
            with lock:
                if tag == b"S" and len(parts) == 2:
                    data[keys[0]] = parts[1]
                    reply = (b"+",)
                elif tag == b"G" and len(parts) == 1:
                    value = data.get(keys[0])
                    reply = (b"-",) if value is None else (b"+", value)
                elif tag == b"C" and parts:
                    reply = (b"+",) if all(k in data for k in keys) else (b"-",)
                else:
                    raise Malformed(f"unknown request {tag!r} with {len(parts)} strings")
            _send(sock, *reply)


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128  # the listen backlog: ranks arriving at once are not made to retry

    def __init__(self, address, secret: bytes):
        super().__init__(address, _Handler)
        self.secret = secret
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.clients: set[socket.socket] = set()

    def verify_request(self, request, client_address) -> bool:
        """At most MAX_CLIENTS connections at once: the ones beyond are closed at once."""
        with self.lock:
            if len(self.clients) >= MAX_CLIENTS:
                return False
            self.clients.add(request)
            return True

    def shutdown_request(self, request) -> None:
        with self.lock:
            self.clients.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """Nothing is printed: rank 0's output is not the place for a stranger's mistakes."""

    def stop(self) -> None:
        """Stop serving and drop every client, as if the serving process had exited."""
        self.shutdown()
        self.server_close()
        with self.lock:
            for sock in self.clients:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    secret = sys.stdin.buffer.readline().strip()
    if not secret:
        print("error: no secret on stdin", flush=True)
        return 1
    try:
        server = _Server((host, port), secret)
    except OSError as e:
        print(f"error: {e.strerror or e}", flush=True)
        return 1
    threading.Thread(target=server.serve_forever, name="tsgen-store", daemon=True).start()
    print("ready", flush=True)
    sys.stdin.buffer.read()  # until rank 0 closes the pipe (or exits)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
