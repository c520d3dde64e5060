"""A minimal socket transfer backend used to test the backend contract suite itself.

Not a product backend (pdcore.builtin.tcp_backend is): just enough of one to exercise every
check of BackendContract / CrossProcessBackendContract, including a dead peer, and a subclass
with a deliberate bug to prove the suite catches corruption.

Wire: frame = header <QI (handle, n) + n x <QQ (dst, len) + the bytes; reply <QB (handle, ok).
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import struct
import threading
from collections.abc import Sequence

from pdcore.errors import TransferError
from pdcore.interfaces.transfer import (
    DONE,
    PENDING,
    BackendContext,
    Capabilities,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    Peer,
    PollResult,
    TransferEngine,
    failed,
)

HEAD = struct.Struct("<QI")
ITEM = struct.Struct("<QQ")
ACK = struct.Struct("<QB")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.dead = ""
        self.handles: set[int] = set()


class RefEngine(TransferEngine):
    name = "ref"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.HOST}), max_batch=300)

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.regions: list[MemoryRegion] = []
        self.lock = threading.Lock()
        self.results: dict[int, PollResult] = {}
        self.ids = itertools.count(1)
        self.server: socket.socket | None = None
        self.accepted: list[socket.socket] = []
        self.outgoing: list[socket.socket] = []
        self.serving: list[threading.Thread] = []
        self.closed = False

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.regions.extend(regions)

    def endpoint(self) -> bytes:
        if self.server is None:
            self.server = socket.create_server((self.ctx.host, 0))
            threading.Thread(target=self._accept, daemon=True).start()
        host, port = self.server.getsockname()[:2]
        return f"{host}:{port}".encode()

    # receiver side
    def _accept(self) -> None:
        assert self.server is not None
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                if self.closed:  # close() has run: nothing may start serving after it
                    conn.close()
                    return
                self.accepted.append(conn)
                serve = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                serve.start()  # started before close() can see it, so close() can join it
                self.serving.append(serve)

    def _inside(self, addr: int, n: int) -> bool:
        return any(r.addr <= addr and addr + n <= r.end for r in self.regions)

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                handle, n = HEAD.unpack(_recv_exact(conn, HEAD.size))
                items = [ITEM.unpack_from(_recv_exact(conn, ITEM.size)) for _ in range(n)]
                ok = 1
                for dst, length in items:
                    data = self._mangle(_recv_exact(conn, length))
                    if self.closed or not self._inside(dst, length):
                        ok = 0
                    elif length:
                        ctypes.memmove(dst, data, length)
                conn.sendall(ACK.pack(handle, ok))
        except (OSError, ConnectionError):
            conn.close()

    def _mangle(self, data: bytes) -> bytes:
        return data

    # sender side
    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        host, port = peer_endpoint.decode().rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
        except OSError as e:
            raise TransferError(f"cannot reach {peer_endpoint!r}: {e}") from e
        sock.settimeout(None)
        self.outgoing.append(sock)
        conn = _Conn(sock)
        threading.Thread(target=self._read_acks, args=(conn,), daemon=True).start()
        return Peer(peer_endpoint, peer_endpoint.decode(), conn)

    def _read_acks(self, conn: _Conn) -> None:
        try:
            while True:
                handle, ok = ACK.unpack(_recv_exact(conn.sock, ACK.size))
                with self.lock:
                    conn.handles.discard(handle)
                    self.results[handle] = DONE if ok else failed("peer refused a range")
        except (OSError, ConnectionError) as e:
            self._fail_all(conn, f"connection lost: {e}")

    def _fail_all(self, conn: _Conn, reason: str) -> None:
        with self.lock:
            conn.dead = reason
            for h in conn.handles:
                self.results[h] = failed(reason)
            conn.handles.clear()

    def write(self, peer: Peer, batch: CopyBatch) -> int:
        conn: _Conn = peer.state
        handle = next(self.ids)
        with self.lock:
            if conn.dead:
                self.results[handle] = failed(conn.dead)
                return handle
            if len(batch) == 0:
                self.results[handle] = DONE
                return handle
            self.results[handle] = PENDING
            conn.handles.add(handle)
        frame = [HEAD.pack(handle, len(batch))]
        frame += [ITEM.pack(int(d), int(n)) for d, n in zip(batch.dst, batch.length, strict=True)]
        frame += [ctypes.string_at(int(s), int(n)) for s, n in zip(batch.src, batch.length,
                                                                    strict=True)]
        try:
            with conn.send_lock:
                conn.sock.sendall(b"".join(frame))
        except OSError as e:
            self._fail_all(conn, f"send failed: {e}")
        return handle

    def poll(self, handle: int) -> PollResult:
        with self.lock:
            r = self.results.get(handle)
            if r is None:
                return failed(f"unknown handle {handle}")
            if r is not PENDING:
                del self.results[handle]
            return r

    def disconnect(self, peer: Peer) -> None:
        peer.state.sock.close()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            serving = list(self.serving)
        if self.server is not None:
            self.server.close()
        for conn in self.accepted + self.outgoing:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone
            conn.close()
        # no serving thread may write into the regions once close() returns: the caller frees
        # them next (a pool's host buffers are mappings, unmapped when freed: a late write
        # would be a segfault of the whole test process)
        for serve in serving:
            if serve is not threading.current_thread():
                serve.join(10)


class CorruptingEngine(RefEngine):
    """Flips the last byte of every copy it receives: the contract must notice."""

    def _mangle(self, data: bytes) -> bytes:
        return data[:-1] + bytes([data[-1] ^ 0xFF]) if data else data


class SilentEngine(RefEngine):
    """Its first close() leaves the connection open but never acknowledges again (a frozen
    peer): a sender would wait forever unless the suite bounds the wait. The second close()
    really closes, so the test leaves no stuck thread behind."""

    silent = False

    def close(self) -> None:
        if not self.silent:
            self.silent = True
            return
        self.silent = False
        super().close()

    def _mangle(self, data: bytes) -> bytes:
        while self.silent:
            threading.Event().wait(0.05)
        return data
