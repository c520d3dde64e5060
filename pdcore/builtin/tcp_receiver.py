"""Receiving side of the `tcp` data plane: a listening socket and one thread per connection.

Lifecycle:
1. `TcpReceiver(host, token, timeout)` binds host:0 and starts the accept thread;
2. `set_regions()` publishes the registered regions (copy-on-write snapshot);
3. per connection: hello with the engine's token within a short deadline (until then the
   connection is only *pending*: bounded per source and in total, the oldest evicted by a flood,
   never counted against the established-peer limit; see pdcore.netguard), then batches:
   header, dst/len arrays, EVERY
   range checked against the registered regions before a byte is written, payload read
   straight into destination memory, ack (ok or the reason);
4. `stop()` closes the listener and every connection and joins the threads (idempotent).

A rejected batch's payload is read and dropped so the connection stays in step.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np

from pdcore.backendkit import (
    MAX_ITEM_BYTES,
    RegionIndex,
    SharedExclusive,
    region_views,
)
from pdcore.builtin import tcp_wire as wire
from pdcore.interfaces.transfer import MemoryRegion
from pdcore.netguard import PENDING_DEADLINE_S, ConnectionGate

log = logging.getLogger(__name__)

MAX_ITEMS = 1 << 21
MAX_CONNECTIONS = 512  # established (handshaken) peers; pending ones are bounded by the gate
# A rejected batch whose payload is larger than this is not drained: the connection is dropped.
MAX_DRAIN = 1 << 34


class _Snapshot:
    __slots__ = ("index", "views")

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        self.index = RegionIndex(regions)
        self.views = region_views(self.index.regions)


class TcpReceiver:
    def __init__(self, host: str, token: bytes, timeout: float, name: str = "tcp") -> None:
        self._token = token
        self._timeout = timeout
        self._name = name
        self._snap = _Snapshot(())
        self.guard = SharedExclusive()  # deregister waits for batches being written
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # every open connection (stop() shuts them)
        self._established = 0
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._listener = socket.create_server((host, 0), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        self.gate = ConnectionGate(f"{name} receiver {self.port}")
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"{name}-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()

    # -- regions -------------------------------------------------------------------------------
    def set_regions(self, regions: Sequence[MemoryRegion]) -> None:
        snap = _Snapshot(regions)
        # Readers pick up the new snapshot at their next batch; removal of memory waits for
        # in-flight batches (see TcpTransferEngine.deregister).
        self._snap = snap

    # -- threads -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                conn, source = self._listener.accept()
            except OSError:
                if self._stopped:
                    return  # listener closed by stop()
                time.sleep(0.05)  # out of file descriptors (a flood): let connections drain
                continue
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                self._conns.add(conn)
                self.gate.admit(conn, str(source[0]))
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name=f"{self._name}-recv-{self.port}")
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            wire.tune(conn)
            if not self._handshake(conn):
                return
            try:
                self._serve_batches(conn)
            finally:
                with self._lock:
                    self._established -= 1
        except (OSError, ValueError) as e:
            if not self._stopped:
                log.warning("%s receiver %s: connection dropped: %s", self._name, self.port, e)
        finally:
            self.gate.discard(conn)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_batches(self, conn: socket.socket) -> None:
        while not self._stopped:
            try:
                head = wire.recv_exact(conn, wire.BATCH.size, None)  # idle: wait freely
            except (wire.PeerClosed, OSError):
                return
            self._batch(conn, head)

    def _reserve(self) -> bool:
        with self._lock:
            if self._established >= MAX_CONNECTIONS:
                return False
            self._established += 1
            return True

    def _handshake(self, conn: socket.socket) -> bool:
        """A stranger gets PENDING_DEADLINE_S to say hello (a real peer does it at once)."""
        deadline = time.monotonic() + min(self._timeout, PENDING_DEADLINE_S)
        try:
            hello = wire.recv_exact(conn, wire.HELLO.size, deadline)
        except (TimeoutError, wire.PeerClosed, OSError):
            return False  # silent, gone, or evicted by a flood: nothing worth a warning
        magic, version, token = wire.HELLO.unpack(hello)
        if magic != wire.HELLO_MAGIC or version != wire.VERSION:
            reason = f"bad hello (magic {magic!r}, version {version}); expected version {wire.VERSION}"
        elif not hmac.compare_digest(token, self._token):
            reason = "wrong data-plane token: connect with this engine's current endpoint()"
        elif not self.gate.promote(conn):
            return False  # evicted meanwhile
        elif not self._reserve():
            reason = f"{MAX_CONNECTIONS} peers are connected already; retry later"
        else:
            try:
                wire.send_buffers(conn, [wire.HELLO_OK], deadline)
            except BaseException:
                with self._lock:
                    self._established -= 1
                raise
            return True
        log.warning("%s receiver %s: refused a connection: %s", self._name, self.port, reason)
        r = wire.encode_reason(reason)
        wire.send_buffers(conn, [wire.HELLO_NO + wire.REASON_LEN.pack(len(r)) + r], deadline)
        return False

    def _batch(self, conn: socket.socket, head: bytes) -> None:
        magic, version, _flags, handle, count, total = wire.BATCH.unpack(head)
        if magic != wire.BATCH_MAGIC or version != wire.VERSION:
            raise ValueError(f"bad batch header (magic {magic!r}, version {version})")
        if count > MAX_ITEMS:
            raise ValueError(f"batch of {count} items exceeds the limit of {MAX_ITEMS}")
        deadline = time.monotonic() + self._timeout
        arrays = np.empty(2 * count, dtype="<u8")
        wire.recv_buffers(conn, [memoryview(arrays).cast("B")], deadline)
        dst, length = arrays[:count].astype(np.uint64), arrays[count:].astype(np.uint64)
        if not self.guard.acquire_shared(self._timeout):
            error: str | None = "receiver is busy deregistering memory; retry"
        else:
            try:
                error = self._write(conn, dst, length, total, deadline)
            finally:
                self.guard.release_shared()
        if error is not None:
            if total > MAX_DRAIN:
                raise ValueError(error + "; payload too large to skip, dropping the connection")
            wire.drain(conn, total, deadline)
        self._ack(conn, handle, error)

    def _write(self, conn: socket.socket, dst: np.ndarray, length: np.ndarray, total: int,
               deadline: float) -> str | None:
        """Check every range, then read the payload into place. Returns why not, or None."""
        if len(length) and int(length.max()) > MAX_ITEM_BYTES:
            return f"an item is longer than {MAX_ITEM_BYTES} bytes; nothing was written"
        if int(length.sum()) != total:
            return (f"header says {total} bytes but the items add up to {int(length.sum())}; "
                    f"nothing was written")
        snap = self._snap
        idx, bad = snap.index.outside("dst", dst, length)
        if bad:
            return (f"receiver {self.host}:{self.port} rejected the batch: {bad} is outside its "
                    f"registered memory; nothing was written")
        offs = dst - snap.index.starts[idx]
        wire.stream(conn, False, (), snap.views, idx.tolist(), offs.tolist(), lens=length.tolist(),
                    deadline=deadline)
        return None

    def _ack(self, conn: socket.socket, handle: int, error: str | None) -> None:
        reason = wire.encode_reason(error) if error else b""
        msg = wire.ACK.pack(wire.ACK_MAGIC, handle, 1 if error else 0, len(reason)) + reason
        wire.send_buffers(conn, [msg], time.monotonic() + self._timeout)

    # -- shutdown ------------------------------------------------------------------------------
    def stop(self, join_timeout: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            conns = list(self._conns)
            threads = list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept(); close() may not
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + join_timeout
        for t in [self._accept_thread, *threads]:
            t.join(max(0.0, deadline - time.monotonic()))
