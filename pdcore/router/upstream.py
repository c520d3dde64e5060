"""The two upstream legs of a PD request: the prefill call and the decode call.

Both record their outcome on the worker's circuit breaker (5xx or transport error = failure;
what the client caused counts neither way: `worker_outcome`, the rule in circuit.py) and
count failures in the metrics. A prefill server answers 502 (PEER_FAULT) when its decode peer
failed the pair: that counts against the decode worker, never against the healthy prefill; a
decode server answers 502 when its prefill peer failed the pair (the proxy blames prefill),
except when the reason is that the prefill instance restarted (error code "peer_restarted",
messages/codes.ErrorCode.PEER_RESTARTED, in decode's answer): the room was
lost with an instance that no longer exists, whose death the router already counted (its own
prefill call failed, health checks failed); the instance now at that URL is new and passed its
health check, so blaming it would re-open a half-open circuit for the whole timeout.
The prefill call is read whole; the decode call is opened as a
stream so the proxy can commit on its first chunk and pass the rest through.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdcore.edge.streams import finish
from pdcore.errors import ERROR_ORIGIN_HEADER
from pdcore.messages.codes import DRAINING_HEADER
from pdcore.route_auth import SERVER_ID_HEADER
from pdcore.router.merge import SSEMerger
from pdcore.router.metrics import RouterMetrics
from pdcore.router.workers import Worker

log = logging.getLogger("pdcore.router.upstream")

PEER_FAULT = 502  # a server's "my peer (decode for P, prefill for D) failed this request"


@dataclass(frozen=True)
class Deadline:
    """When the router gives up on a request (`at`, event-loop time) and when the client's own
    `timeout` runs out (`client_at`; None without one). Once that has passed, whatever goes
    wrong (a cut connection, the router's deadline, a peer-fault report) is the client's doing."""

    at: float
    client_at: float | None = None

    def left(self) -> float:
        return max(0.0, self.at - asyncio.get_running_loop().time())

    def client_expired(self) -> bool:
        return (self.client_at is not None
                and asyncio.get_running_loop().time() >= self.client_at)


def client_caused(headers: httpx.Headers | None) -> bool:
    return headers is not None and headers.get(ERROR_ORIGIN_HEADER, "").strip().lower() == "client"


def worker_outcome(status: int | None, client_marked: bool, deadline: Deadline) -> bool | None:
    """How one upstream answer counts on the worker's circuit: True success, False the worker's
    fault, None the client's doing (counted apart). `status` None: transport error or timeout.
    PEER_FAULT is a success of the answering worker: the proxy blames its peer."""
    if client_marked:
        return None
    if status is not None and (status < 500 or status == PEER_FAULT):
        return True
    return None if deadline.client_expired() else False


def draining(worker: Worker, headers: httpx.Headers | None) -> bool:
    """The worker answered that it drains (DRAINING_HEADER): out of rotation now, until its
    /health is 200 again (a restarted server); no circuit counts it (True)."""
    if headers is None or not headers.get(DRAINING_HEADER):
        return False
    if worker.healthy:
        log.warning("%s worker %s is draining: out of rotation until its /health is 200",
                    worker.worker_type, worker.url)
    worker.healthy = False
    worker.health_successes = 0
    return True


def refused(worker: Worker, exc: BaseException) -> None:
    """A connection the worker's address refused: nothing listens there (a drained server
    that exited, one restarting): out of rotation now, until its /health is 200 again."""
    if isinstance(exc, httpx.ConnectError) and worker.healthy:
        log.warning("%s worker %s refused the connection: out of rotation until its /health "
                    "is 200", worker.worker_type, worker.url)
        worker.healthy = False
        worker.health_successes = 0


def record(worker: Worker, outcome: bool | None, metrics: RouterMetrics, kind: str) -> None:
    """Put `outcome` on the worker's circuit; a client-caused one (None) is counted as the
    client's error `kind` (an HTTP status, or timeout)."""
    if outcome is None:
        worker.circuit.record_client_error()
        metrics.worker_error("client", kind)
    else:
        worker.circuit.record(outcome)


class UpstreamClients:
    """One httpx.AsyncClient per worker URL for the data path.

    httpcore scans its whole pool on every request assignment (quadratic in the number of
    pooled connections); one shared client for all workers made throughput collapse at 32
    concurrent requests. Per-worker pools stay small. A removed worker's client is kept (and
    reused if the URL comes back) until `aclose()`, so in-flight calls are never cut.
    """

    def __init__(self, connect_timeout: float = 10.0,
                 headers: dict[str, str] | None = None, verify: Any = True) -> None:
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._verify = verify  # https:// workers: RouterConfig.upstream_ssl()
        self._connect_timeout = connect_timeout
        self._headers = headers or {}  # the router's --api-key for its workers

    def get(self, worker: Worker) -> httpx.AsyncClient:
        client = self._clients.get(worker.url)
        if client is None:
            client = httpx.AsyncClient(
                # idle connections expire well before the workers' keep-alive (120 s,
                # pdcore/edge/connections.py): httpx's default 5 s equals uvicorn's default,
                # so a request could go out on a connection the worker was just closing
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                    keepalive_expiry=30.0),
                timeout=httpx.Timeout(None, connect=self._connect_timeout),
                headers=self._headers, verify=self._verify,
            )
            self._clients[worker.url] = client
        return client

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


def exc_reason(exc: BaseException) -> str:
    """An exception as one short line: its type, and its text when it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def request_timeout(deadline: Deadline) -> httpx.Timeout:
    left = max(0.001, deadline.left())
    return httpx.Timeout(left, connect=min(left, 10.0))


@dataclass
class PrefillResult:
    status: int | None  # None: transport error or timeout
    body: bytes = b""
    content_type: str | None = None
    error: str | None = None
    client_caused: bool = False  # marked by the server, or failed after the client's timeout
    headers: dict[str, str] = field(default_factory=dict)  # the origin mark, passed on

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


async def call_prefill(
    client: httpx.AsyncClient, worker: Worker, url: str, content: bytes,
    headers: dict[str, str], deadline: Deadline, *, metrics: RouterMetrics,
) -> PrefillResult:
    """POST to the prefill worker and read the whole answer; never raises transport errors."""
    try:
        resp = await asyncio.wait_for(
            client.post(url, content=content, headers=headers, timeout=request_timeout(deadline)),
            timeout=max(0.001, deadline.left()),
        )
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        outcome = worker_outcome(None, False, deadline)
        reason = exc_reason(exc)
        refused(worker, exc)
        if outcome is None:
            record(worker, None, metrics, "timeout")
            log.info("prefill %s: the request's own timeout passed (%s)", url, reason)
        else:
            record(worker, outcome, metrics, "transport")
            metrics.worker_error("prefill", "transport")
            log.warning("prefill %s failed: %s", url, reason)
        return PrefillResult(None, error=reason, client_caused=outcome is None)
    marked = client_caused(resp.headers)
    outcome = worker_outcome(resp.status_code, marked, deadline)
    if draining(worker, resp.headers):
        metrics.worker_error("prefill", "draining")
    else:
        record(worker, outcome, metrics, str(resp.status_code))
    if not 200 <= resp.status_code < 300 and outcome is not None:
        metrics.worker_error("prefill", str(resp.status_code))
        log.warning("prefill %s answered %d: %s", url, resp.status_code, resp.text[:300])
    return PrefillResult(resp.status_code, resp.content, resp.headers.get("content-type"),
                         client_caused=outcome is None,
                         headers={ERROR_ORIGIN_HEADER: "client"} if marked else {})


class DecodeLeg:
    """One decode call. Holds the in-flight count and the connection until `release()`."""

    def __init__(self, worker: Worker, metrics: RouterMetrics) -> None:
        self.worker = worker
        self._metrics = metrics
        self._resp: httpx.Response | None = None
        self._iter: AsyncIterator[bytes] | None = None
        self._released = False
        self.status = 0
        self.content_type: str | None = None
        self.body = b""  # whole body (non-stream or error) or the first chunk (stream)
        self.client_caused = False  # the answer is the client's doing (see worker_outcome)
        self.headers: dict[str, str] = {}  # the origin mark, passed on to the client
        self.server_id = ""  # the id D's answer names (route_auth.SERVER_ID_HEADER)
        # a stream's second chunk, read before commit (`read_next`): once it came (or the stream
        # ended) D is streaming tokens, so it has the KV and P's answer no longer matters
        self._next: asyncio.Task[bytes] | None = None
        self.flowing = False
        worker.in_flight += 1

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    async def open(
        self, client: httpx.AsyncClient, url: str, content: bytes, headers: dict[str, str],
        deadline: Deadline, first_only: bool,
    ) -> None:
        """Send; read the whole body, or only the first chunk of a successful stream."""
        request = client.build_request(
            "POST", url, content=content, headers=headers, timeout=request_timeout(deadline)
        )
        try:
            self._resp = await client.send(request, stream=True)
            self.status = self._resp.status_code
            self.content_type = self._resp.headers.get("content-type")
            self.server_id = self._resp.headers.get(SERVER_ID_HEADER, "")
            if client_caused(self._resp.headers):
                self.headers = {ERROR_ORIGIN_HEADER: "client"}
            outcome = worker_outcome(self.status, bool(self.headers), deadline)
            self.client_caused = outcome is None
            if draining(self.worker, self._resp.headers):
                self._metrics.worker_error("decode", "draining")
            else:
                record(self.worker, outcome, self._metrics, str(self.status))
                if not self.ok and outcome is not None:
                    self._metrics.worker_error("decode", str(self.status))
            if first_only and self.ok:
                self._iter = self._resp.aiter_bytes()
                self.body = await anext(self._iter, b"")  # type: ignore[arg-type]
            else:
                self.body = await self._resp.aread()
        except httpx.HTTPError as exc:
            outcome = worker_outcome(None, False, deadline)
            self.client_caused = outcome is None
            refused(self.worker, exc)
            record(self.worker, outcome, self._metrics, "timeout")
            if outcome is not None:
                self._metrics.worker_error("decode", "transport")
            raise

    def read_next(self) -> asyncio.Task[bytes]:
        """Start reading a stream's second chunk (once); the task ends when D streams on."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_task(self._second_chunk())
        return self._next

    async def _second_chunk(self) -> bytes:
        chunk = await anext(self._iter, b"") if self._iter is not None else b""  # type: ignore[arg-type]
        self.flowing = True
        return chunk

    async def raw(self) -> AsyncIterator[bytes]:
        """The committed stream's bytes as they come (first chunk, second, the rest); transport
        errors are raised (router/migrate.py moves the stream on them)."""
        if self.body:
            yield self.body
        if self._iter is None:
            return
        if self._next is not None:
            second = await self._next
            if second:
                yield second
        async for chunk in self._iter:
            yield chunk

    async def stream(self, merger: SSEMerger | None, deadline: Deadline) -> AsyncIterator[bytes]:
        """The committed stream: first chunk, then the rest; an error ends it with one
        `data: {"error": ...}` event (the status line is already sent)."""
        loop = asyncio.get_running_loop()
        first = merger.feed(self.body) if merger else self.body
        if first:
            yield first
        if self._iter is None:
            return
        try:
            if self._next is not None:  # the second chunk, read before commit
                second = await self._next
                out = merger.feed(second) if merger and second else second
                if out:
                    yield out
            async for chunk in self._iter:
                if loop.time() > deadline.at:
                    raise asyncio.TimeoutError("request deadline passed while streaming")
                out = merger.feed(chunk) if merger else chunk
                if out:
                    yield out
            if merger:
                tail = merger.flush()
                if tail:
                    yield tail
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            outcome = worker_outcome(None, False, deadline)
            record(self.worker, outcome, self._metrics, "timeout")
            if outcome is not None:
                self._metrics.worker_error("decode", "stream")
            message = f"decode stream from {self.worker.url} broke: {type(exc).__name__}: {exc}"
            log.warning(message)
            event = {"error": {"code": "decode_stream_error", "message": message}}
            yield b"data: " + json.dumps(event).encode() + b"\n\n"

    async def release(self) -> None:
        """Give back the in-flight count and close the connection; the close runs to its end
        even when the caller is being cancelled (edge/streams.py says why)."""
        if self._released:
            return
        self._released = True
        self.worker.in_flight -= 1
        await finish(self._close())

    async def _close(self) -> None:
        if self._next is not None and not self._next.done():
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
        if self._resp is not None:
            try:
                await self._resp.aclose()
            except Exception:  # closing a broken connection must not mask the real outcome
                log.debug("closing decode response failed", exc_info=True)
