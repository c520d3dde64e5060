"""The zmq control plane of one KV manager: typed messages to and from peers.

Control plane lifecycle (one per manager):
1. `start()` binds a PULL socket on the manager's host (ephemeral port) and starts the receive
   thread; the returned `tcp://ip:port` is what peers send to;
2. the receive thread decodes each message (version and auth token checked first; a bad one is
   logged, counted and dropped; an authentic one of another protocol version goes to
   `on_foreign`, which refuses it in a way an older peer understands) and hands it to
   `on_message`; every `tick` seconds it calls `on_tick` (timeouts) on the same thread, so
   handlers never race each other;
3. `send(addr, msg)` pushes through a per-peer PUSH socket, never blocking: linger 0, and a
   full queue (dead peer) makes send() return False instead of waiting;
4. `drop(addr)` closes a peer's socket (it died); `close()` stops the thread and the sockets.

Floods: zmq accepts and handshakes connections on its own I/O thread and fair-queues the peers
that completed the ZMTP greeting, so idle connections cannot block real peers; what they could
do is hold descriptors and memory, hence a short handshake deadline and a message size cap on
the PULL socket (a Register or TransferInfo is at most a few MiB).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from pdcore.disagg import wire
from pdcore.disagg.common import Counters, advertised_host
from pdcore.errors import ProtocolError
from pdcore.netguard import is_loopback

log = logging.getLogger(__name__)

_SNDHWM = 10_000
_HANDSHAKE_MS = 5_000  # zmq drops a connection that has not greeted within this
_MAX_MSG = 64 << 20


class ControlPlane:
    def __init__(self, host: str, token: str | None, label: str,
                 on_message: Callable[[wire.Message], None], on_tick: Callable[[], None],
                 tick: float = 0.05,
                 on_foreign: Callable[[wire.VersionMismatch], None] | None = None) -> None:
        self.host, self.token, self.label = host, token, label
        self._on_message, self._on_tick, self._tick = on_message, on_tick, tick
        self._on_foreign = on_foreign
        self.counters = Counters()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        self._pull.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG)
        self._push: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.addr = ""

    def start(self) -> str:
        port = self._pull.bind_to_random_port(f"tcp://{self.host}")
        self.addr = f"tcp://{advertised_host(self.host)}:{port}"
        if not self.token and not is_loopback(self.host):
            log.warning("%s: control plane binds %s without --disaggregation-auth-token: "
                        "anyone on the network can send it control messages; give prefill and "
                        "decode the same token", self.label, self.host)
        self._thread = threading.Thread(target=self._loop, name=f"pd-{self.label}-recv",
                                        daemon=True)
        self._thread.start()
        return self.addr

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                timeout_ms = max(0.0, next_tick - time.monotonic()) * 1000
                if poller.poll(timeout_ms):
                    while True:
                        try:
                            data = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(data)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self._tick
                    self._guarded(self._on_tick)
        finally:
            self._pull.close(linger=0)

    def _dispatch(self, data: bytes) -> None:
        try:
            msg = wire.decode(data, self.token)
        except wire.VersionMismatch as e:
            self.counters.add("rejected_messages")
            self.counters.add("version_mismatches")
            log.error("%s: refused control message (%d bytes): %s", self.label, len(data), e)
            if self._on_foreign is not None:
                self._guarded(self._on_foreign, e)
            return
        except ProtocolError as e:
            self.counters.add("rejected_messages")
            log.warning("%s: rejected control message (%d bytes): %s", self.label, len(data), e)
            return
        self.counters.add("received_messages")
        self._guarded(self._on_message, msg)

    def _guarded(self, fn: Callable, *a: object) -> None:
        try:
            fn(*a)
        except Exception:  # one bad message must not kill the control plane; log with stack
            self.counters.add("handler_errors")
            log.exception("%s: control-plane handler failed", self.label)

    def send(self, addr: str, msg: wire.Message) -> bool:
        """Queue msg for addr without blocking; False when it cannot be queued (peer gone)."""
        return self.send_raw(addr, wire.encode(msg, self.token), type(msg).__name__)

    def send_raw(self, addr: str, data: bytes, what: str = "message") -> bool:
        """send() of bytes encoded already (a refusal in an older peer's version)."""
        if self._stop.is_set():
            return False
        with self._push_lock:
            entry = self._push.get(addr)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, _SNDHWM)
                sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
                sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
                sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
                sock.connect(addr)
                entry = self._push[addr] = (sock, threading.Lock())
        sock, lock = entry
        with lock:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError as e:  # Again (queue full) or a socket closed by drop()
                self.counters.add("send_failures")
                log.warning("%s: cannot send %s to %s: %s", self.label, what, addr, e)
                return False
        self.counters.add("sent_messages")
        return True

    def drop(self, addr: str) -> None:
        with self._push_lock:
            entry = self._push.pop(addr, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(linger=0)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._push_lock:
            entries, self._push = list(self._push.values()), {}
        for sock, lock in entries:
            with lock:  # a short linger flushes the last Failed/Abort notices to live peers
                sock.close(linger=200)
        if self._thread is None:
            self._pull.close(linger=0)
        elif self._thread.is_alive():  # a handler is stuck; never hang close() on ctx.term()
            log.error("%s: receive thread did not stop within 5s; leaking its socket", self.label)
            return
        self._ctx.term()
