"""`tcp` transfer engine: the pure-Python default data plane over loopback or LAN sockets.

Lifecycle:
1. `TcpTransferEngine(ctx)` starts a receiver (listening on ctx.host, ephemeral port) and a
   small sender pool (ctx.thread_pool_size threads); PDCORE_TCP_TIMEOUT (ctx.env, seconds,
   default 30) bounds every batch on both sides;
2. `register(regions)`: what peers may write into here, and what write() may read from;
3. `endpoint()`: JSON {host, port, token}; the token (random per engine) is checked on every
   data connection, so only a peer that got the endpoint through the control plane can write;
4. `connect(endpoint, peer_regions)`: opens and handshakes a first connection (fails early and
   clearly), keeps the peer's regions for a sender-side check;
5. `write(peer, batch)`: checks src against local and dst against the peer's regions, then a
   worker streams header + payload (sendmsg, many buffers per call) on a pooled connection and
   waits for the ack; `poll(handle)` reports PENDING / DONE / FAILED(reason naming the peer);
6. `close()`: cancels queued batches, shuts every socket, joins the threads (idempotent).
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pdcore.backendkit import (
    HandleEngine,
    HandleTable,
    RegionIndex,
    SharedExclusive,
    batch_arrays,
    read_timeout,
    region_views,
)
from pdcore.builtin import tcp_wire as wire
from pdcore.builtin.tcp_receiver import MAX_ITEMS, TcpReceiver
from pdcore.errors import TransferError
from pdcore.interfaces.transfer import (
    DONE,
    BackendContext,
    Capabilities,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    Peer,
    PollResult,
    failed,
)

log = logging.getLogger(__name__)

TIMEOUT_ENV = "PDCORE_TCP_TIMEOUT"
DEFAULT_TIMEOUT = 30.0


@dataclass(eq=False)
class _TcpPeer:
    host: str
    port: int
    token: bytes
    index: RegionIndex
    idle: deque = field(default_factory=deque)  # pooled connections, reused per batch
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}"


class TcpTransferEngine(HandleEngine):
    name = "tcp"
    capabilities = Capabilities(
        memory_kinds=frozenset({MemoryKind.HOST, MemoryKind.SHM}),
        max_batch=MAX_ITEMS,
        needs_metadata=False,
    )

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.timeout = read_timeout(ctx.env, TIMEOUT_ENV, DEFAULT_TIMEOUT)
        self._token = secrets.token_bytes(wire.TOKEN_LEN)
        self._regions: tuple[MemoryRegion, ...] = ()
        # (index, views) swapped as one object so write() never pairs one with the other's
        # predecessor
        self._local: tuple[RegionIndex, list[memoryview]] = (RegionIndex(()), [])
        self._send_guard = SharedExclusive()  # deregister waits for sends reading local memory
        self._generation = 0  # bumped by deregister: batches queued before it are not sent
        self.handles = HandleTable("tcp")
        self._lock = threading.Lock()
        self._active: set[socket.socket] = set()
        self._peers: set[_TcpPeer] = set()
        self._closed = False
        self._pool = ThreadPoolExecutor(max(1, ctx.thread_pool_size), thread_name_prefix="tcp-send")
        self._receiver = TcpReceiver(ctx.host, self._token, self.timeout)

    # -- memory --------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        for r in regions:
            if r.kind not in self.capabilities.memory_kinds:
                raise TransferError(
                    f"tcp backend cannot use {r.kind.value} memory (region {r.name or hex(r.addr)});"
                    f" it moves host memory only: use a host or shm memory pool"
                )
        self._set_regions(self._regions + tuple(regions))

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        gone = {(r.addr, r.length) for r in regions}
        # Wait for batches reading from, or being written into, memory about to go away.
        guards = (self._send_guard, self._receiver.guard)
        taken = []
        try:
            for g in guards:
                if not g.acquire_exclusive(self.timeout):
                    raise TransferError(f"tcp: deregister timed out after {self.timeout}s "
                                        f"waiting for in-flight batches to finish")
                taken.append(g)
            self._set_regions(tuple(r for r in self._regions if (r.addr, r.length) not in gone))
            self._generation += 1
        finally:
            for g in taken:
                g.release_exclusive()

    def _set_regions(self, regions: tuple[MemoryRegion, ...]) -> None:
        self._regions = regions
        index = RegionIndex(regions)
        self._local = (index, region_views(index.regions))
        self._receiver.set_regions(regions)

    # -- peers ---------------------------------------------------------------------------------
    def endpoint(self) -> bytes:
        return json.dumps({"backend": "tcp", "host": self._receiver.host,
                           "port": self._receiver.port, "token": self._token.hex()}).encode()

    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        self._check_open()
        try:
            info = json.loads(bytes(peer_endpoint).decode())
            host, port, token = str(info["host"]), int(info["port"]), bytes.fromhex(info["token"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise TransferError(
                f"tcp: malformed peer endpoint {bytes(peer_endpoint)[:200]!r} ({e}); expected the "
                f"JSON blob of the peer's TcpTransferEngine.endpoint()"
            ) from None
        state = _TcpPeer(host, port, token, RegionIndex(peer_regions))
        conn = self._open(state, time.monotonic() + self.timeout)  # fail early, with the reason
        state.idle.append(conn)
        with self._lock:
            self._peers.add(state)
        return Peer(endpoint=bytes(peer_endpoint), key=state.label, state=state)

    def disconnect(self, peer: Peer) -> None:
        self._drop(peer.state)

    def _drop(self, state: _TcpPeer) -> None:
        """Forget the peer and close its idle connections (a busy one closes after its batch)."""
        with self._lock:
            self._peers.discard(state)
        with state.lock:
            state.closed = True
            conns = list(state.idle)
            state.idle.clear()
        for c in conns:
            c.close()

    def _open(self, peer: _TcpPeer, deadline: float) -> socket.socket:
        try:
            conn = socket.create_connection((peer.host, peer.port),
                                            timeout=max(0.001, deadline - time.monotonic()))
        except OSError as e:
            raise TransferError(f"tcp: cannot connect to peer {peer.label}: {e}") from None
        try:
            wire.tune(conn)
            wire.send_buffers(conn, [wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, peer.token)],
                              deadline)
            answer = wire.recv_exact(conn, 4, deadline)
            if answer != wire.HELLO_OK:
                (n,) = wire.REASON_LEN.unpack(wire.recv_exact(conn, 2, deadline))
                reason = wire.recv_exact(conn, n, deadline).decode("utf-8", "replace")
                raise TransferError(f"tcp: peer {peer.label} refused the connection: {reason}")
        except (OSError, TransferError) as e:
            conn.close()
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"tcp: handshake with peer {peer.label} failed: {e}") from None
        return conn

    # -- transfers -----------------------------------------------------------------------------
    def write(self, peer: Peer, batch: CopyBatch) -> int:
        self._check_open()
        state: _TcpPeer = peer.state
        if state.closed:
            return self.handles.add(failed(f"tcp: peer {state.label} was disconnected"))
        n = len(batch)
        if n == 0:
            return self.handles.add(DONE)
        if n > MAX_ITEMS:
            return self.handles.add(failed(f"tcp: batch of {n} copies exceeds max_batch "
                                            f"{MAX_ITEMS}; split it (CopyBatch.split)"))
        src, dst, length = batch_arrays(batch)
        local, views = self._local
        sidx, bad = local.outside("src", src, length)
        if bad:
            return self.handles.add(failed(
                f"tcp: {bad} is not inside memory registered with this engine; register() it "
                f"first. Nothing was sent to {state.label}"))
        # the receiver checks again; this only fails early and clearly
        if len(state.index) and (bad := state.index.outside("dst", dst, length)[1]):
            return self.handles.add(failed(f"tcp: {bad} is outside the regions peer "
                                            f"{state.label} registered; nothing was sent"))
        offs = src - local.starts[sidx]
        fut = self._pool.submit(self._send, state, dst, length, views, sidx, offs,
                                generation=self._generation)
        return self.handles.add(fut)

    def _send(self, peer: _TcpPeer, dst: np.ndarray, length: np.ndarray,
              views: list[memoryview], sidx: np.ndarray, offs: np.ndarray,
              *, generation: int) -> PollResult:
        deadline = time.monotonic() + self.timeout
        with peer.lock:
            conn = peer.idle.popleft() if peer.idle else None
        try:
            if conn is None:
                conn = self._open(peer, deadline)
        except TransferError as e:
            return failed(str(e))
        if not self._send_guard.acquire_shared(self.timeout):
            conn.close()
            return failed("tcp: local memory is being deregistered; batch not sent")
        if generation != self._generation:
            self._send_guard.release_shared()
            with peer.lock:
                peer.idle.append(conn)
            return failed("tcp: local memory was deregistered while the batch was queued; "
                          "nothing was sent")
        with self._lock:
            self._active.add(conn)
        reusable = False
        try:
            total = int(length.sum())
            head = wire.BATCH.pack(wire.BATCH_MAGIC, wire.VERSION, 0, 0, len(dst), total)
            arrays = np.concatenate([dst, length]).astype("<u8", copy=False)
            wire.stream(conn, True, (head, memoryview(arrays).cast("B")), views, sidx.tolist(),
                        offs.tolist(), lens=length.tolist(), deadline=deadline)
            magic, _h, status, n = wire.ACK.unpack(wire.recv_exact(conn, wire.ACK.size, deadline))
            if magic != wire.ACK_MAGIC:
                return failed(f"tcp: peer {peer.label} sent a malformed ack ({magic!r})")
            reason = wire.recv_exact(conn, n, deadline).decode("utf-8", "replace") if n else ""
            reusable = True
            return failed(f"tcp: {reason}") if status else DONE
        except TimeoutError:
            return failed(f"tcp: peer {peer.label} did not finish the batch within "
                          f"{self.timeout}s ({TIMEOUT_ENV}); is it frozen or overloaded?")
        except wire.PeerClosed:
            return failed(f"tcp: peer {peer.label} closed the connection mid-batch "
                          f"(peer exited or restarted?)")
        except OSError as e:
            if self._closed:
                return failed("tcp: engine closed while the batch was in flight")
            return failed(f"tcp: connection to peer {peer.label} failed: {e}")
        finally:
            self._send_guard.release_shared()
            with self._lock:
                self._active.discard(conn)
            with peer.lock:
                if reusable and not peer.closed and not self._closed:
                    peer.idle.append(conn)
                    conn = None
            if conn is not None:
                conn.close()

    # -- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        if not self._mark_closed():
            return
        with self._lock:  # what is still held now, connections a send opened meanwhile included
            active, peers = list(self._active), list(self._peers)
            self._peers.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in active:  # unblocks workers stuck on a frozen peer
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for p in peers:
            self._drop(p)
        self._pool.shutdown(wait=True)
        self._receiver.stop()
