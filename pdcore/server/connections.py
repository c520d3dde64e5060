"""Bounded connections on every HTTP port (the servers' and the router's), #30 item 3.

uvicorn reads a request's headers and body with no deadline and takes as many connections as the
process has file descriptors: 20,000 sockets that never finished their headers kept the router's
`/health` unreachable for the whole hold, and the accept loop's "Too many open files" logged
180,000 tracebacks. `PortGate` bounds each port:

1. **Header deadline** (PDSERVE_HTTP_HEADER_TIMEOUT_S, 10 s): a connection whose request line and
   headers are not complete that long after its first byte (or after it opened, or after its
   last response on a kept-alive connection) is closed.
2. **Body deadline** (PDSERVE_HTTP_BODY_TIMEOUT_S, 30 s): a request body that stalls that long
   between two reads is closed (the route sees the client gone and frees what it holds).
3. **Connection limit** (PDSERVE_HTTP_MAX_CONNECTIONS; default 4096, and at most the file
   descriptor limit less 512 for the engine's own): when full, a new connection evicts the
   kept-alive connection idle longest, else the one that has waited longest for its headers, so
   a real request (a probe's `/health`) always gets in; only when every connection is serving a
   request is the new one closed at once.
4. **Keep-alive** (PDSERVE_HTTP_KEEPALIVE_S, 120 s): how long an idle kept-alive connection stays
   open (uvicorn's `timeout_keep_alive`, whose default is 5 s). Routers and load balancers keep
   idle upstream connections far longer (sglang-router's HTTP pool 90 s, ours 30 s, nginx and
   cloud balancers 60 s); a server that closes first races the client's next request on that
   connection, which then fails and is retried: behind sglang-router a prefill server counted two
   requests for one prompt. Idle connections are evictable (item 3), so the longer hold costs
   no capacity under a flood.
5. **No log line per connection**: closes are counted in `/metrics`
   (`pdserve_http_connections_closed_total{reason}`, `pdserve_http_connections{state}`) and
   summarised in one line at most every 10 s; the accept loop's descriptor-exhaustion errors and
   uvicorn's per-connection warnings are folded into that summary (`QuietFilter`).
`raise_nofile_limit()` lifts the soft file-descriptor limit to the hard one at start.

`guarded_protocol(gate)` is the uvicorn HTTP protocol class (`uvicorn.Config(http=...)`) that
reports to the gate; the gate sweeps its connections once a second on the server's loop.
(pdcore.netguard.ConnectionGate does the same eviction for the threaded, blocking listeners of
P's bootstrap server and the tcp backend; this one adds deadlines and a total limit for the
asyncio HTTP ports.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdcore.errors import ConfigError

log = logging.getLogger("pdcore.connections")

HEADER_TIMEOUT_ENV = "PDSERVE_HTTP_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "PDSERVE_HTTP_BODY_TIMEOUT_S"
MAX_CONNECTIONS_ENV = "PDSERVE_HTTP_MAX_CONNECTIONS"
KEEPALIVE_ENV = "PDSERVE_HTTP_KEEPALIVE_S"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEPALIVE_S = 120.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 4096
RESERVED_FDS = 512  # the engine's own sockets, files and pipes
SWEEP_S = 1.0
SUMMARY_EVERY_S = 10.0
REASONS = ("header_timeout", "body_timeout", "evicted", "refused")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name}={raw!r}: give a number of seconds > 0")
    return value


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
    raw = os.environ.get(MAX_CONNECTIONS_ENV, "").strip()
    cap = max(64, nofile - RESERVED_FDS) if nofile > 0 else DEFAULT_MAX_CONNECTIONS
    if not raw:
        return min(DEFAULT_MAX_CONNECTIONS, cap)
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{MAX_CONNECTIONS_ENV}={raw!r}: give a connection count >= 1")
    return min(int(raw), cap)


class PortGate:
    """The connections of one listening port: who waits for headers since when, who reads a
    body, what was closed and why."""

    def __init__(self, header_timeout_s: float | None = None, body_timeout_s: float | None = None,
                 limit: int | None = None) -> None:
        self.header_timeout_s = header_timeout_s or _env_float(HEADER_TIMEOUT_ENV,
                                                               DEFAULT_HEADER_TIMEOUT_S)
        self.body_timeout_s = body_timeout_s or _env_float(BODY_TIMEOUT_ENV,
                                                           DEFAULT_BODY_TIMEOUT_S)
        self.limit = limit or max_connections(raise_nofile_limit())
        self.pending: dict[Any, float] = {}  # waiting for headers, oldest first -> since
        self.idle: dict[Any, None] = {}  # kept alive between requests, longest idle first
        self.open: set[Any] = set()
        self.closed = dict.fromkeys(REASONS, 0)
        self.quieted = 0  # log lines QuietFilter folded into the summary
        self._reported = dict(self.closed)
        self._last_summary = time.monotonic()
        self._sweeper: asyncio.TimerHandle | None = None

    # -- protocol events ------------------------------------------------------------------------
    def opened(self, proto: Any) -> bool:
        """A new connection; False when it must be closed at once (full of busy connections)."""
        if self._sweeper is None:
            self._schedule()
        while len(self.open) >= self.limit and (self.idle or self.pending):
            oldest = next(iter(self.idle or self.pending))
            self._close(oldest, "evicted")
        if len(self.open) >= self.limit:
            self.closed["refused"] += 1
            return False
        self.open.add(proto)
        self.pending[proto] = time.monotonic()
        return True

    def waiting(self, proto: Any) -> None:
        """A new request began on a kept-alive connection: its header deadline starts now."""
        self.idle.pop(proto, None)
        if proto in self.open:
            self.pending.pop(proto, None)
            self.pending[proto] = time.monotonic()

    def kept_alive(self, proto: Any) -> None:
        """A response is complete and the connection stays open for the next request."""
        if proto in self.open and proto not in self.pending:
            self.idle[proto] = None

    def headers_done(self, proto: Any) -> None:
        self.pending.pop(proto, None)

    def lost(self, proto: Any) -> None:
        self.open.discard(proto)
        self.pending.pop(proto, None)
        self.idle.pop(proto, None)

    # -- the sweep ------------------------------------------------------------------------------
    def _schedule(self) -> None:
        self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self.sweep)

    def sweep(self) -> None:
        now = time.monotonic()
        try:
            for proto, since in list(self.pending.items()):
                if now - since < self.header_timeout_s:
                    break  # oldest first: the rest are younger
                self._close(proto, "header_timeout")
            for proto in list(self.open):
                cycle = getattr(proto, "cycle", None)
                if (cycle is not None and not cycle.response_complete and cycle.more_body
                        and now - getattr(proto, "pd_last_data", now) > self.body_timeout_s):
                    self._close(proto, "body_timeout")
            self._summarise(now)
        finally:
            self._schedule()

    def _close(self, proto: Any, reason: str) -> None:
        self.lost(proto)
        self.closed[reason] += 1
        transport = getattr(proto, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.abort()  # no lingering: the descriptor is free at once

    def _summarise(self, now: float) -> None:
        if now - self._last_summary < SUMMARY_EVERY_S:
            return
        delta = {k: v - self._reported[k] for k, v in self.closed.items() if v > self._reported[k]}
        if delta or self.quieted:
            log.warning("HTTP connections closed in the last %.0f s: %s (open %d, waiting for "
                        "headers %d, limit %d)%s", now - self._last_summary,
                        ", ".join(f"{v} {k}" for k, v in delta.items()) or "none",
                        len(self.open), len(self.pending), self.limit,
                        f"; {self.quieted} repeated log lines folded in" if self.quieted else "")
        self._reported, self.quieted, self._last_summary = dict(self.closed), 0, now

    def collect(self) -> list[Any]:
        """Prometheus families (register `MetricsCollector(gate)`)."""
        state = GaugeMetricFamily("pdserve_http_connections", "Open HTTP connections of this "
                                  "port, and those still waiting for their headers",
                                  labels=["state"])
        state.add_metric(["open"], len(self.open))
        state.add_metric(["waiting_headers"], len(self.pending))
        closed = CounterMetricFamily("pdserve_http_connections_closed", "HTTP connections the "
                                     "server closed: header or body deadline passed, evicted "
                                     "for a newer one at the limit, refused when full",
                                     labels=["reason"])
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


def guarded_protocol(gate: PortGate) -> type:
    """uvicorn's h11 protocol, reporting to `gate`."""

    class GuardedH11Protocol(H11Protocol):
        pd_last_data = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.pd_last_data = time.monotonic()
            if not gate.opened(self):
                transport.abort()

        def data_received(self, data: bytes) -> None:
            self.pd_last_data = time.monotonic()
            before = self.cycle
            if before is not None and before.response_complete and self not in gate.pending:
                gate.waiting(self)  # the next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not before:
                gate.headers_done(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                gate.kept_alive(self)

        def connection_lost(self, exc: Exception | None) -> None:
            gate.lost(self)
            super().connection_lost(exc)

    return GuardedH11Protocol


def keepalive_s() -> float:
    """uvicorn's timeout_keep_alive for the servers' and the router's ports (item 4)."""
    return _env_float(KEEPALIVE_ENV, DEFAULT_KEEPALIVE_S)


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


def tls_settings(certfile: str | None, keyfile: str | None, cert_flag: str,
                 key_flag: str) -> dict[str, str]:
    """uvicorn's HTTPS settings for a port (servers: --ssl-certfile/--ssl-keyfile; router:
    --tls-cert-path/--tls-key-path), checked now: the pair loads as a certificate chain and
    its key, else ConfigError naming the flags. {} without them (plain HTTP)."""
    import ssl

    if not certfile and not keyfile:
        return {}
    if not certfile or not keyfile:
        raise ConfigError(f"HTTPS needs both {cert_flag} and {key_flag} (PEM files)")
    for path, flag in ((certfile, cert_flag), (keyfile, key_flag)):
        if not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(f"{flag} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            os.path.expanduser(certfile), os.path.expanduser(keyfile))
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{cert_flag} {certfile} with {key_flag} {keyfile}: not a PEM "
                          f"certificate chain and its private key ({e})") from None
    return {"ssl_certfile": os.path.expanduser(certfile),
            "ssl_keyfile": os.path.expanduser(keyfile)}
