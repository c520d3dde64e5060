"""Bounded connections on every HTTP port (the servers' and the router's), #30 item 3, #44 item 4.

uvicorn reads a request's headers and body with no deadline and takes as many connections as the
process has file descriptors: 20,000 sockets that never finished their headers kept the router's
`/health` unreachable for the whole hold, and 4,400 that sent their headers and then a body byte
every 15 s (each "serving a request", never evicted) made 12 of 19 health probes on a decode
server time out. `PortGate` bounds each port:

1. **Header deadline** (PDSERVE_HTTP_HEADER_TIMEOUT_S, 10 s): a connection whose request line and
   headers are not complete that long after its first byte (or after it opened, or after its
   last response on a kept-alive connection) gets a 408 and is closed.
2. **Whole-body deadline with a minimum rate** (PDSERVE_HTTP_BODY_TIMEOUT_S, 30 s;
   PDSERVE_HTTP_BODY_MIN_RATE, 1024 bytes/s; PDSERVE_HTTP_BODY_MAX_S, 300 s): a body must be
   complete within 30 s of its headers, plus 1 s for every 1,024 bytes that arrived, and never
   later than 300 s after them; else a 408 and the close (the route sees the client gone and frees
   what it holds). Trickling bytes buys nothing: 1 byte every 15 s is closed after 30 s. Time
   the server itself stops reading (uvicorn's 64 KiB read-ahead, the app not consuming) is not
   held against the client.
3. **Pending connections per peer** (PDSERVE_HTTP_MAX_PENDING_PER_PEER, 128): a connection is
   *pending* while it reads its request (headers or body); once its request is whole it is
   *serving* and no longer counted (the router reaches a server from one address with hundreds
   of requests in flight; those are the server's queue, bounded elsewhere). A peer is
   `netguard.peer_key`: an IPv4 address, an IPv6 /64, and all of loopback as one, so cycling
   through 127.0.0.x earns nothing. A peer's pending connection over the limit evicts that
   peer's *slowest* pending one (the lowest bytes/s since its request began), never the new
   one: a flood only pushes out its own connections, and a router or a NAT sharing the
   flood's address still gets in, its requests arriving in milliseconds. Only connections that
   sent something or are pending over 1 s are judged: asyncio accepts a batch of connections
   before it reads any, and a router's request accepted just before a burst is unread, not
   slow (so a peer can pass its limit by one accept batch, until its next connection).
4. **Connection limit** (PDSERVE_HTTP_MAX_CONNECTIONS; default 4096, and at most the file
   descriptor limit less 512 for the engine's own): when full (a flood from many peers), a new
   connection evicts the slowest reader of the port (ranked once a second: those pending over
   1 s at less than the minimum body rate, slowest first; then kept-alive connections idle
   longest; then the faster pending; past the ranked ones, the oldest pending, then the idle
   longest), so a real request (a probe's `/health`) always gets in; only when every
   connection is serving a request is the new one closed at once.
5. **Keep-alive** (PDSERVE_HTTP_KEEPALIVE_S, 120 s): how long an idle kept-alive connection stays
   open (uvicorn's `timeout_keep_alive`, whose default is 5 s). Routers and load balancers keep
   idle upstream connections far longer (sglang-router's HTTP pool 90 s, ours 30 s, nginx and
   cloud balancers 60 s); a server that closes first races the client's next request on that
   connection, which then fails and is retried: behind sglang-router a prefill server counted two
   requests for one prompt. Idle connections are not pending (a router's pool keeps up to 256)
   and are evictable only at the connection limit, after the slow pending ones.
6. **Send deadline** (PDSERVE_HTTP_SEND_TIMEOUT_S, 60 s): a client that stops reading its
   response (the transport's write buffer stays full that long: a stream it never reads) is
   closed, so its request is aborted and frees its decode slot and pages.
7. **No log line per connection**: closes are counted in `/metrics`
   (`pdserve_http_connections_closed_total{reason}`, `pdserve_http_connections{state}`) and
   summarised in one line at most every 10 s, naming the peers closed most; the accept loop's
   descriptor-exhaustion errors and uvicorn's per-connection warnings are folded into that
   summary (`QuietFilter`).
`raise_nofile_limit()` lifts the soft file-descriptor limit to the hard one at start.

`guarded_http.guarded_protocol(gate)` is the uvicorn HTTP protocol class
(`uvicorn.Config(http=...)`) that reports to the gate, its app behind `guarded_http.BodyFirst`
(the app sees a request once its body is whole); the gate sweeps its connections once a second
on the server's loop. (pdcore.netguard.ConnectionGate bounds the threaded, blocking listeners of
P's bootstrap server and the tcp backend the same way: per peer, in all, and by a whole
deadline.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter, deque
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdcore.edge.guarded_http import guarded_protocol
from pdcore.env import ENV, Env

log = logging.getLogger("pdcore.connections")

# the variables (names, defaults, parsers) are declared in pdcore/env.py
HEADER_TIMEOUT_ENV = Env.pdserve_http_header_timeout_s.name
BODY_TIMEOUT_ENV = Env.pdserve_http_body_timeout_s.name
BODY_MIN_RATE_ENV = Env.pdserve_http_body_min_rate.name  # bytes/s: each buys one more second
BODY_MAX_ENV = Env.pdserve_http_body_max_s.name
MAX_CONNECTIONS_ENV = Env.pdserve_http_max_connections.name
PER_PEER_ENV = Env.pdserve_http_max_pending_per_peer.name
KEEPALIVE_ENV = Env.pdserve_http_keepalive_s.name
SEND_TIMEOUT_ENV = Env.pdserve_http_send_timeout_s.name
DEFAULT_MAX_CONNECTIONS = Env.pdserve_http_max_connections.default
DEFAULT_PER_PEER = Env.pdserve_http_max_pending_per_peer.default
RESERVED_FDS = 512  # the engine's own sockets, files and pipes
GRACE_S = 1.0  # pending this long, a connection is ranked by its rate (a real one is done by then)
SWEEP_S = 1.0
SUMMARY_EVERY_S = 10.0
REASONS = ("header_timeout", "body_timeout", "send_timeout", "evicted", "peer_limit", "refused")


def raise_nofile_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def max_connections(nofile: int) -> int:
    cap = max(64, nofile - RESERVED_FDS) if nofile > 0 else DEFAULT_MAX_CONNECTIONS
    return min(ENV.pdserve_http_max_connections, cap)


def _timeout_408(what: str) -> bytes:
    body = json.dumps({"error": {"message": what, "type": "invalid_request_error",
                                 "param": None, "code": 408}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


class PortGate:
    """The connections of one listening port: which are pending (reading their request: headers,
    then body) since when and how fast, per peer; which serve a request; which idle between
    requests; what was closed and why. The protocol keeps on each connection `pd_peer`,
    `pd_start` (its request began), `pd_bytes` (since then) and `pd_body_bytes`."""

    def __init__(self, header_timeout_s: float | None = None, body_timeout_s: float | None = None,
                 limit: int | None = None, per_peer: int | None = None) -> None:
        self.header_timeout_s = header_timeout_s or ENV.pdserve_http_header_timeout_s
        self.body_timeout_s = body_timeout_s or ENV.pdserve_http_body_timeout_s
        self.body_min_rate = ENV.pdserve_http_body_min_rate
        self.body_max_s = max(self.body_timeout_s, ENV.pdserve_http_body_max_s)
        self.limit = limit or max_connections(raise_nofile_limit())
        self.per_peer = per_peer or ENV.pdserve_http_max_pending_per_peer
        self.send_timeout_s = ENV.pdserve_http_send_timeout_s
        self.stalled: dict[Any, float] = {}  # a response it does not read -> since
        self.pending: dict[Any, float] = {}  # waiting for headers, oldest first -> since
        self.reading: dict[Any, float] = {}  # reading a body, oldest first -> headers done at
        self.idle: dict[Any, None] = {}  # kept alive between requests, longest idle first
        self.peers: dict[str, dict[Any, None]] = {}  # pending or reading, per peer
        self.heard: dict[str, dict[Any, None]] = {}  # those of them read from at least once
        self.open: set[Any] = set()
        self.victims: deque[tuple[Any, float]] = deque()  # the last sweep's slowest first
        self.closed = dict.fromkeys(REASONS, 0)
        self.by_peer: Counter[str] = Counter()  # closed since the last summary
        self.quieted = 0  # log lines QuietFilter folded into the summary
        self._reported = dict(self.closed)
        self._last_summary = time.monotonic()
        self._sweeper: asyncio.TimerHandle | None = None

    # -- protocol events ------------------------------------------------------------------------
    def opened(self, proto: Any) -> bool:
        """A new connection; False when it must be closed at once (full of busy connections)."""
        if self._sweeper is None:
            self._schedule()
        now = time.monotonic()
        proto.pd_start, proto.pd_bytes = now, 0
        self._make_room_for(proto.pd_peer, now)
        while len(self.open) >= self.limit:
            victim = self._slowest_of_port()
            if victim is None:
                self.closed["refused"] += 1
                return False
            self._close(victim, "evicted")
        self.open.add(proto)
        self.pending[proto] = now
        self.peers.setdefault(proto.pd_peer, {})[proto] = None
        return True

    def waiting(self, proto: Any) -> None:
        """A new request began on a kept-alive connection: pending again, deadline from now."""
        self.idle.pop(proto, None)
        if proto in self.open:
            now = time.monotonic()
            proto.pd_start, proto.pd_bytes = now, 0
            self.pending.pop(proto, None)
            self.pending[proto] = now
            if proto not in self.peers.get(proto.pd_peer, ()):
                self._make_room_for(proto.pd_peer, now)
                self.peers.setdefault(proto.pd_peer, {})[proto] = None

    def headers_done(self, proto: Any) -> None:
        self.pending.pop(proto, None)
        cycle = proto.cycle
        if proto in self.open and cycle.more_body and not cycle.response_complete:
            self.reading[proto] = time.monotonic()
            proto.pd_body_bytes = len(cycle.body)
        else:
            self._served(proto)

    def body_done(self, proto: Any) -> None:
        self.reading.pop(proto, None)
        self._served(proto)

    def kept_alive(self, proto: Any) -> None:
        """A response is complete and the connection stays open for the next request."""
        if proto in self.open and proto not in self.pending:
            self.reading.pop(proto, None)
            self._served(proto)
            self.idle[proto] = None

    def write_paused(self, proto: Any, paused: bool) -> None:
        """The client stopped reading what the server writes (the transport's buffer is full),
        or read it again."""
        if not paused:
            self.stalled.pop(proto, None)
        elif proto in self.open:
            self.stalled.setdefault(proto, time.monotonic())

    def lost(self, proto: Any) -> None:
        self.open.discard(proto)
        self.stalled.pop(proto, None)
        self.pending.pop(proto, None)
        self.reading.pop(proto, None)
        self.idle.pop(proto, None)
        self._served(proto)

    def read_from(self, proto: Any) -> None:
        """The first bytes of a pending connection's request were read."""
        if proto in self.pending or proto in self.reading:
            self.heard.setdefault(proto.pd_peer, {})[proto] = None

    def _served(self, proto: Any) -> None:
        """No longer pending: out of its peer's count."""
        peer = getattr(proto, "pd_peer", "")
        for table in (self.peers, self.heard):
            mine = table.get(peer)
            if mine is not None and mine.pop(proto, 0) is None and not mine:
                del table[peer]

    # -- who goes when full ---------------------------------------------------------------------
    def _make_room_for(self, peer: str, now: float) -> None:
        """The peer is at its pending limit: its slowest pending connections go. Only those
        that sent something (or were pending over the grace) are judged: asyncio makes a batch
        of accepted connections before it reads any, so a router's request accepted just before
        a flood's burst has not been read yet, and is neither old nor slow."""
        mine = self.peers.get(peer)
        if mine is None or len(mine) < self.per_peer:
            return
        excess = len(mine) - self.per_peer + 1
        while excess > 0 and mine:  # the common case under a flood: the oldest is ripe and slow
            oldest = next(iter(mine))
            age = now - oldest.pd_start
            if not (age > GRACE_S and oldest.pd_bytes < self.body_min_rate * age):
                break
            self._close(oldest, "peer_limit")
            excess -= 1
        heard = self.heard.get(peer)
        if excess > 0 and heard:
            ripe = sorted(heard, key=lambda p: p.pd_bytes / max(now - p.pd_start, 1e-3))
            for victim in ripe[:excess]:
                self._close(victim, "peer_limit")

    def _slowest_of_port(self) -> Any | None:
        while self.victims:
            proto, start = self.victims.popleft()
            if proto.pd_start == start and (proto in self.pending or proto in self.reading
                                            or proto in self.idle):
                return proto
        # between sweeps: the oldest pending that sent something (an unread one may be a real
        # request, see _make_room_for) among the 64 oldest, else the oldest pending; then the
        # oldest reading a body, then the idle longest
        for i, proto in enumerate(self.pending):
            if proto.pd_bytes or i >= 64:
                return proto if proto.pd_bytes else next(iter(self.pending))
        for table in (self.reading, self.idle):
            if table:
                return next(iter(table))
        return None

    def _rank(self, now: float) -> None:
        """Whom a full port evicts first: pending over the grace below the minimum rate (the
        slowest first), then the idle longest, then the other pending over the grace (slowest
        first); the rest only between sweeps (`_slowest_of_port`)."""
        ranked = sorted([(p.pd_bytes / (now - p.pd_start), p)
                         for table in (self.pending, self.reading) for p in table
                         if now - p.pd_start > GRACE_S], key=lambda rp: rp[0])
        slow = [(p, p.pd_start) for rate, p in ranked if rate < self.body_min_rate]
        self.victims = deque(slow)
        self.victims.extend((p, p.pd_start) for p in self.idle)
        self.victims.extend((p, p.pd_start) for rate, p in ranked[len(slow):])

    # -- the sweep ------------------------------------------------------------------------------
    def _schedule(self) -> None:
        self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self.sweep)

    def body_deadline(self, proto: Any, since: float) -> float:
        allowed = self.body_timeout_s + proto.pd_body_bytes / self.body_min_rate
        return since + min(self.body_max_s, allowed)

    def sweep(self) -> None:
        now = time.monotonic()
        try:
            for proto, since in list(self.pending.items()):
                if now - since < self.header_timeout_s:
                    break  # oldest first: the rest are younger
                self._close(proto, "header_timeout", f"the request's headers did not arrive "
                            f"within {self.header_timeout_s:g} s")
            for proto, since in list(self.reading.items()):
                if now > self.body_deadline(proto, since) and not proto.flow.read_paused:
                    self._close(proto, "body_timeout", "the request's body did not arrive in "
                                f"time ({self.body_timeout_s:g} s, plus 1 s per "
                                f"{self.body_min_rate:g} bytes received, at most "
                                f"{self.body_max_s:g} s)")
            for proto, since in list(self.stalled.items()):
                if now - since > self.send_timeout_s:
                    self._close(proto, "send_timeout")  # its stream's request is aborted
            self._rank(now)
            self._summarise(now)
        finally:
            self._schedule()

    def _close(self, proto: Any, reason: str, why: str = "") -> None:
        self.lost(proto)
        self.closed[reason] += 1
        self.by_peer[getattr(proto, "pd_peer", "unknown")] += 1
        transport = getattr(proto, "transport", None)
        if transport is None or transport.is_closing():
            return
        cycle = getattr(proto, "cycle", None)
        if why and (cycle is None or not cycle.response_started):
            transport.write(_timeout_408(why))  # a deadline: say so, then close
            transport.close()
        else:
            transport.abort()  # no lingering: the descriptor is free at once

    def _summarise(self, now: float) -> None:
        if now - self._last_summary < SUMMARY_EVERY_S:
            return
        delta = {k: v - self._reported[k] for k, v in self.closed.items() if v > self._reported[k]}
        if delta or self.quieted:
            top = ", ".join(f"{peer} {n}" for peer, n in self.by_peer.most_common(3))
            log.warning("HTTP connections closed in the last %.0f s: %s%s (open %d, pending %d "
                        "from %d peers, limit %d, %d per peer)%s", now - self._last_summary,
                        ", ".join(f"{v} {k}" for k, v in delta.items()) or "none",
                        f"; most from {top}" if top else "", len(self.open),
                        len(self.pending) + len(self.reading), len(self.peers), self.limit,
                        self.per_peer,
                        f"; {self.quieted} repeated log lines folded in" if self.quieted else "")
        self._reported, self.quieted, self._last_summary = dict(self.closed), 0, now
        self.by_peer.clear()

    def collect(self) -> list[Any]:
        """Prometheus families (register `MetricsCollector(gate)`)."""
        state = GaugeMetricFamily("pdserve_http_connections", "Open HTTP connections of this "
                                  "port; those waiting for their headers, reading their body, "
                                  "idle between requests", labels=["state"])
        for name, n in (("open", len(self.open)), ("waiting_headers", len(self.pending)),
                        ("reading_body", len(self.reading)), ("idle", len(self.idle))):
            state.add_metric([name], n)
        closed = CounterMetricFamily("pdserve_http_connections_closed", "HTTP connections the "
                                     "server closed: header or body deadline passed (408), "
                                     "evicted at the port's limit or at the peer's pending "
                                     "limit, refused when full", labels=["reason"])
        for reason, n in self.closed.items():
            closed.add_metric([reason], n)
        return [state, closed]


class MetricsCollector:
    def __init__(self, gate: PortGate) -> None:
        self._gate = gate

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        yield from self._gate.collect()


class QuietFilter(logging.Filter):
    """Folds per-connection log lines (the accept loop out of descriptors, uvicorn's "Invalid
    HTTP request") into the gate's summary instead of one line (and traceback) each."""

    NOISE = ("socket.accept() out of system resource", "Invalid HTTP request received")

    def __init__(self, gate: PortGate) -> None:
        super().__init__()
        self._gate = gate

    def filter(self, record: logging.LogRecord) -> bool:
        if any(n in str(record.msg) for n in self.NOISE):
            self._gate.quieted += 1
            return False
        return True


def keepalive_s() -> float:
    """uvicorn's timeout_keep_alive for the servers' and the router's ports (item 4)."""
    return ENV.pdserve_http_keepalive_s


def install(app: Any, registry: Any | None = None) -> tuple[PortGate, type]:
    """A gate for the app's port: its metrics in `registry`, the noise filters on the loggers;
    returns (gate, the protocol class for uvicorn.Config(http=...))."""
    gate = PortGate()
    app.state.connection_gate = gate
    if registry is not None:
        registry.register(MetricsCollector(gate))
    quiet = QuietFilter(gate)
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(quiet)
    return gate, guarded_protocol(gate)
