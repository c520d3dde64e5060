"""Admission control for listening sockets that strangers can reach (layer 0: stdlib only).

A connection that has not yet proved itself (no handshake, no complete request) is *pending*.
Pending connections are what a flood is made of, so they are bounded per source address and in
total, and an overflow evicts the oldest pending connection instead of refusing the new one:
a real peer handshakes within milliseconds of connecting and is therefore never the oldest,
while an idle flood only ever pushes out its own earlier connections. A pending connection also
has a short deadline (the owner arms it as a socket timeout). Once a connection proves itself,
`promote()` takes it out of the pending set, so established peers are never counted against
(or evicted by) strangers.

A source is a peer as `peer_key` counts it: one IPv4 address, one IPv6 /64, and every loopback
address as one peer (127.0.0.2 ... 127.255.255.254 are the same machine as 127.0.0.1, so cycling
through them earns a flood nothing).

Lifecycle: `admit(sock, source)` right after accept(); `promote(sock)` after the handshake
(False: it was evicted meanwhile, close it); `discard(sock)` when the connection ends. Owners
whose connections must finish within a whole deadline (P's bootstrap server: one request per
connection) call `sweep(deadline_s)` now and then: it closes every pending connection admitted
longer ago than that (`timed_out` counts them), whatever it trickles meanwhile.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import threading
import time
from collections import OrderedDict

log = logging.getLogger(__name__)

PENDING_DEADLINE_S = 5.0  # a handshake or first request must complete within this
MAX_PENDING = 256
MAX_PENDING_PER_SOURCE = 64


class ConnectionGate:
    def __init__(self, name: str, max_pending: int = MAX_PENDING,
                 max_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        self.name = name
        self.max_pending, self.max_per_source = max(1, max_pending), max(1, max_per_source)
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, str] = OrderedDict()  # oldest first
        self._since: dict[socket.socket, float] = {}
        self._per_source: dict[str, int] = {}
        self.evicted = 0
        self.timed_out = 0

    def admit(self, sock: socket.socket, source: str) -> None:
        """Count sock as pending; evict the oldest pending connection(s) when over a limit."""
        victims: list[socket.socket] = []
        source = peer_key(source)
        with self._lock:
            self._pending[sock] = source
            self._since[sock] = time.monotonic()
            self._per_source[source] = self._per_source.get(source, 0) + 1
            if self._per_source[source] > self.max_per_source:
                victims.append(next(s for s, src in self._pending.items() if src == source))
                self._forget(victims[-1])
            while len(self._pending) > self.max_pending:
                victims.append(next(iter(self._pending)))
                self._forget(victims[-1])
            self.evicted += len(victims)
            n = self.evicted
        _wake(victims)
        if victims and (n <= len(victims) or n % 1000 < len(victims)):  # not once per victim
            log.warning("%s: connection flood from %s: evicted %d idle unauthenticated "
                        "connections so far", self.name, source, n)

    def promote(self, sock: socket.socket) -> bool:
        """sock proved itself: no longer pending. False when it had been evicted."""
        with self._lock:
            if sock not in self._pending:
                return False
            self._forget(sock)
            return True

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            if sock in self._pending:
                self._forget(sock)

    def sweep(self, deadline_s: float, farewell: bytes = b"") -> int:
        """Close the pending connections admitted more than deadline_s ago (first sending them
        `farewell`, e.g. an HTTP 408, where the socket takes it at once); returns how many."""
        cutoff = time.monotonic() - deadline_s
        with self._lock:
            late = []
            for sock in self._pending:  # oldest first
                if self._since[sock] > cutoff:
                    break
                late.append(sock)
            for sock in late:
                self._forget(sock)
            self.timed_out += len(late)
        for sock in late if farewell else ():
            try:
                sock.send(farewell, socket.MSG_DONTWAIT)
            except OSError:
                pass
        _wake(late)
        return len(late)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _forget(self, sock: socket.socket) -> None:
        source = self._pending.pop(sock)
        del self._since[sock]
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            del self._per_source[source]


def _wake(socks: list[socket.socket]) -> None:
    for s in socks:
        try:  # wakes the thread blocked on it; it closes the socket itself
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@functools.lru_cache(maxsize=1 << 14)
def peer_key(host: str) -> str:
    """The peer a per-peer connection limit counts `host` (a socket's address) as: an IPv4
    address; an IPv6 /64 (what one host or one customer gets); "loopback" for every loopback
    address (all of 127.0.0.0/8 and ::1 are this machine); an IPv4-mapped IPv6 address as its
    IPv4 address; anything else (a Unix socket's path, "") as written."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host or "unknown"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def is_loopback(host: str) -> bool:
    """True when binding `host` exposes nothing beyond this machine."""
    h = host.strip("[]")
    return h == "localhost" or h.startswith("127.") or h == "::1"
