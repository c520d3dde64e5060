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
   full queue (dead peer) makes send() return False instead of waiting. The sockets are
   bounded: at most MAX_PEERS (the least recently used is closed for a new one) and one idle
   for IDLE_CLOSE_S is closed on the next tick (reply addresses come from peers' messages, so
   an unbounded table is a descriptor leak a peer can drive);
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
from collections import OrderedDict
from collections.abc import Callable

import zmq

from pdcore.disagg import wire
from pdcore.disagg.common import Counters, advertised_host
from pdcore.errors import ProtocolError
from pdcore.netguard import is_loopback

log = logging.getLogger(__name__)

_SNDHWM = 10_000
MAX_PEERS = 256
IDLE_CLOSE_S = 300.0
_LOG_EVERY_S = 10.0  # rejected messages: one log line per kind per this many seconds
_HANDSHAKE_MS = 5_000  # zmq drops a connection that has not greeted within this
_MAX_MSG = 64 << 20


class ControlPlane:
    def __init__(self, host: str, token: str | None, label: str,
                 on_message: Callable[[wire.Message], None], on_tick: Callable[[], None],
                 tick: float = 0.05,
                 *, on_foreign: Callable[[wire.VersionMismatch], None] | None = None) -> None:
        self.host, self.token, self.label = host, token, label
        self._on_message, self._on_tick, self._tick = on_message, on_tick, tick
        self._on_foreign = on_foreign
        self.counters = Counters()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        self._pull.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG)
        # addr -> (socket, its lock, last use); least recently used first
        self._push: OrderedDict[str, tuple[zmq.Socket, threading.Lock, float]] = OrderedDict()
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last logged, suppressed)
        self._next_sweep = 0.0
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
                            frames = self._pull.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self._tick
                    self._guarded(self._on_tick)
                    self._sweep_idle()
        finally:
            self._pull.close(linger=0)

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames, self.token)
        except wire.VersionMismatch as e:
            self.counters.add("rejected_messages")
            self.counters.add("version_mismatches")
            self._log_rejected(logging.ERROR, "refused", frames, e)
            if self._on_foreign is not None:
                self._guarded(self._on_foreign, e)
            return
        except ProtocolError as e:
            self.counters.add("rejected_messages")
            self._log_rejected(logging.WARNING, "rejected", frames, e)
            return
        self.counters.add("received_messages")
        self._guarded(self._on_message, msg)

    def _log_rejected(self, level: int, kind: str, frames: list[bytes], err: Exception) -> None:
        """A forged-message flood must not become a log flood: one line per kind per
        _LOG_EVERY_S, saying how many were not logged since (the counters count them all)."""
        now = time.monotonic()
        last, suppressed = self._logged.get(kind, (-_LOG_EVERY_S, 0))
        if now - last < _LOG_EVERY_S:
            self._logged[kind] = (last, suppressed + 1)
            return
        self._logged[kind] = (now, 0)
        more = f" ({suppressed} more since the last line)" if suppressed else ""
        log.log(level, "%s: %s control message (%d bytes): %s%s", self.label, kind,
                sum(map(len, frames)), err, more)

    def _guarded(self, fn: Callable, *a: object) -> None:
        try:
            fn(*a)
        except Exception:  # one bad message must not kill the control plane; log with stack
            self.counters.add("handler_errors")
            log.exception("%s: control-plane handler failed", self.label)

    def send(self, addr: str, msg: wire.Message) -> bool:
        """Queue msg for addr without blocking; False when it cannot be queued (peer gone)."""
        return self.send_raw(addr, wire.encode(msg, self.token), type(msg).__name__)

    def send_raw(self, addr: str, frames: list[bytes], what: str = "message") -> bool:
        """send() of frames encoded already (a refusal in another peer's version)."""
        if self._stop.is_set():
            return False
        now = time.monotonic()
        evicted = None
        with self._push_lock:
            entry = self._push.pop(addr, None)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, _SNDHWM)
                sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
                sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
                sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
                sock.connect(addr)
                entry = (sock, threading.Lock(), now)
                if len(self._push) >= MAX_PEERS:
                    evicted = self._push.popitem(last=False)[1]
            self._push[addr] = (entry[0], entry[1], now)  # most recently used last
        if evicted is not None:
            self.counters.add("peer_sockets_evicted")
            self._close_entry(evicted)
        sock, lock = entry[0], entry[1]
        with lock:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
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
            self._close_entry(entry)

    def peer_sockets(self) -> int:
        with self._push_lock:
            return len(self._push)

    @staticmethod
    def _close_entry(entry: tuple[zmq.Socket, threading.Lock, float], linger: int = 0) -> None:
        with entry[1]:
            entry[0].close(linger=linger)

    def _sweep_idle(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(IDLE_CLOSE_S / 10, 30.0)
        with self._push_lock:
            idle = [a for a, e in self._push.items() if now - e[2] > IDLE_CLOSE_S]
            entries = [self._push.pop(a) for a in idle]
        for e in entries:
            self._close_entry(e)
        if entries:
            self.counters.add("peer_sockets_idle_closed", len(entries))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._push_lock:
            entries, self._push = list(self._push.values()), OrderedDict()
        for entry in entries:  # a short linger flushes the last Failed/Abort notices
            self._close_entry(entry, linger=200)
        if self._thread is None:
            self._pull.close(linger=0)
        elif self._thread.is_alive():  # a handler is stuck; never hang close() on ctx.term()
            log.error("%s: receive thread did not stop within 5s; leaking its socket", self.label)
            return
        self._ctx.term()
