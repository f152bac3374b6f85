"""tsgen's own store server: a dict behind a socket, in a process of its own.

Rank 0 of a world using tsgen's store (tsgen.runtime.store.TcpStore) starts this
file as a child process: `python store_server.py HOST PORT`. It binds, prints
`ready` (or `error: why`) on stdout, serves until its stdin closes (rank 0 left
or died), then exits. Serving from a thread of rank 0 instead starved the
other ranks whenever rank 0 sat in a C call that holds the GIL (measured:
nvshmem4py's nvshmem_free waiting for a rank that was itself waiting for the
store). Standard library only, so it runs by path without tsgen on sys.path.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import sys
import threading

# A message is a tag byte, a count, and that many length-prefixed byte strings.
# Requests: b"S" (key, value), b"G" (key), b"C" (keys...); replies: b"+" (values...)
# or b"-" (a key is missing).

_COUNT = struct.Struct("!I")


def _send(sock: socket.socket, tag: bytes, *parts: bytes) -> None:
    sock.sendall(tag + _COUNT.pack(len(parts)) + b"".join(_COUNT.pack(len(p)) + p for p in parts))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[bytes, list[bytes]]:
    head = _recv_exact(sock, 1 + _COUNT.size)
    tag, (count,) = head[:1], _COUNT.unpack(head[1:])
    parts = []
    for _ in range(count):
        (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
        parts.append(_recv_exact(sock, n))
    return tag, parts


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, lock = self.server.data, self.server.lock
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with lock:
            self.server.clients.add(self.request)
        try:
            self._serve(data, lock)
        finally:
            with lock:
                self.server.clients.discard(self.request)

    def _serve(self, data: dict[str, bytes], lock: threading.Lock) -> None:
        while True:
            try:
                tag, parts = _recv(self.request)
            except (ConnectionError, OSError):
                return
            with lock:
                if tag == b"S":
                    data[parts[0].decode()] = parts[1]
                    reply = (b"+",)
                elif tag == b"G":
                    value = data.get(parts[0].decode())
                    reply = (b"-",) if value is None else (b"+", value)
                elif tag == b"C":
                    reply = (b"+",) if all(p.decode() in data for p in parts) else (b"-",)
                else:
                    return  # not our protocol: drop the connection
            _send(self.request, *reply)


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address):
        super().__init__(address, _Handler)
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.clients: set[socket.socket] = set()

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
    try:
        server = _Server((host, port))
    except OSError as e:
        print(f"error: {e.strerror or e}", flush=True)
        return 1
    threading.Thread(target=server.serve_forever, name="tsgen-store", daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # until rank 0 closes the pipe (or exits)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
