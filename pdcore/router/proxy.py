"""PD fan-out of one generation request (`/generate`, `/v1/completions`, `/v1/chat/completions`).

1. Parse the JSON body (400 on bad JSON or an empty batch); work out batch size, stream,
   logprobs and the routing text; deadline = now + --request-timeout-secs (whole request), or
   sooner with the request's own `timeout`: now + timeout + CLIENT_TIMEOUT_GRACE_S (the servers
   answer that timeout themselves; the grace lets their 504 arrive first).
2. Per attempt (at most --retry-max-retries): pick (P, D) among available workers (503
   `server_selection_failed` when a role has none), inject bootstrap_host/port and a fresh
   bootstrap_room, and start the P call and the D call at the same time.
3. Commit point: without logprobs, D's whole body, or for a stream its first body chunk and then
   either P's good answer or D's second chunk, whichever comes first (D may send a stream's
   first event before the KV arrives; once it streams on it has the KV); with logprobs, both
   whole bodies (D stream: its first chunk). Before it, a failure of one leg cancels the
   other, so D never waits for KV from a dead P (nor P for a dead D). 408/429/500/502/503/504 and
   transport errors are retried after 50 ms x 1.5^n (capped, +-20 % jitter); other non-2xx
   answers go to the client as the worker sent them. Nothing is retried after commit. What the
   client caused is never retried nor counted against a worker (circuit.py has the rule): an
   answer marked `X-PD-Error-Origin: client` goes to the client as it is, and a failure once
   the request's own `timeout` has passed is a 504 `request_timeout`.
4. After commit the client gets D's status, content-type and body; a stream is passed through
   (rewritten per SSE event when prefill logprobs are merged). An unfinished P call completes in
   the background (bounded by the deadline); its errors are logged and counted on P's circuit.
5. Every leg gives back its in-flight count and connection on every path.
6. A client that goes away before commit (even before any byte came back) cancels both legs
   at once, which closes both upstream connections: P and D abort the room and free its pages.
   After commit the streaming response notices the disconnect and closes the decode leg.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcore.edge import tracing
from pdcore.edge.streams import finish
from pdcore.errors import InvalidRequestError
from pdcore.messages.codes import ErrorCode, code_of
from pdcore.route_refusal import DECODE_REFUSED
from pdcore.router.config import RouterConfig
from pdcore.router.merge import (
    EchoSSEMerger,
    SSEMerger,
    batch_size,
    inject_bootstrap,
    merge_echo_json,
    merge_json,
    prefill_echo_logprobs,
    prefill_echo_stream,
    prefill_input_logprobs,
    wants_logprobs,
)
from pdcore.router.metrics import RouterMetrics, error_code
from pdcore.router.migrate import LEG_ONLY, LegResponse, Migration, Prober
from pdcore.router.migrate_many import mover
from pdcore.router.pairs import PairCircuits, PairKey
from pdcore.router.policies import DPRanks, Policy, routing_text
from pdcore.router.upstream import (
    PEER_FAULT,
    Deadline,
    DecodeLeg,
    PrefillResult,
    UpstreamClients,
    call_prefill,
    record,
)
from pdcore.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pdcore.router.proxy")

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
DECODE_REFUSED_BYTES = DECODE_REFUSED.encode()  # in P's 403 when decode refused the route
FORWARD_HEADERS = ("authorization", "x-request-id", "x-correlation-id")
_KIND = {408: "timeout", 429: "rate_limited", 500: "internal_error", 502: "bad_gateway",
         503: "unavailable", 504: "timeout"}
CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it
CLIENT_TIMEOUT_GRACE_S = 1.0  # the router waits this long past the request's own `timeout`
CLIENT_TIMEOUT = "the request's own timeout passed before the workers answered"


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so nothing else is
    waiting on receive())."""
    while (await request.receive()).get("type") != "http.disconnect":
        pass


async def _drop_legs(p_task: asyncio.Task[Any], d_task: asyncio.Task[Any], leg: DecodeLeg) -> None:
    """An uncommitted attempt's end: both calls cancelled, the decode connection closed."""
    for task in (p_task, d_task):
        task.cancel()
    await asyncio.gather(p_task, d_task, return_exceptions=True)
    await leg.release()


@dataclass
class Failure:
    status: int
    code: str
    message: str
    retriable: bool
    pair: bool = False  # a peer-fault report: the pair failed (router/pairs.py)


def _pair_outcome(outcome: object) -> tuple[bool | None, str]:
    """A pair failure (router/pairs.py), or None: P's good answer is the pair's success."""
    failed = isinstance(outcome, Failure) and outcome.pair
    return (False, getattr(outcome, "message", "")) if failed else (None, "")


def _failed_role(failure: Failure | None) -> str:
    """The role a failure names (its code starts with it), else 'pair'."""
    role = failure.code.split("_", 1)[0] if failure else ""
    return role if role in ("prefill", "decode") else "pair"


def error_response(status: int, code: str, message: str, request_id: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status,
        headers={"x-request-id": request_id},
    )


def request_deadline(body: dict, router_timeout: float) -> Deadline:
    """The request's deadline (see the module doc, step 1)."""
    now = asyncio.get_running_loop().time()
    t = body.get("timeout")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf"):
        return Deadline(now + min(router_timeout, t + CLIENT_TIMEOUT_GRACE_S), now + t)
    return Deadline(now + router_timeout)


def _client_timeout() -> Failure:
    return Failure(504, "request_timeout", CLIENT_TIMEOUT, retriable=False)


def _upstream_failure(role: str, worker: Worker, status: int, body: bytes,
                      pair: bool = False) -> Failure:
    text = body[:800].decode("utf-8", "replace")
    return Failure(
        status, f"{role}_{_KIND.get(status, 'error')}",
        f"{role.capitalize()} server error ({status}) from {worker.url}: {text}",
        retriable=status in RETRY_STATUSES, pair=pair,
    )


def _resigned(leg: DecodeLeg, d: Worker) -> Failure | None:
    """D refused a route we signed for another server id (D restarted since our last probe):
    sign for the one there now and retry; nobody's fault, no circuit counts it."""
    if leg.status != 403 or not leg.server_id or leg.server_id == d.server_id or \
            code_of(leg.body) != ErrorCode.ROUTE_REFUSED:  # a refusal of something else
        return None
    log.info("decode worker %s is server %s now (was %s)", d.url, leg.server_id,
             d.server_id or "unknown")
    d.server_id = leg.server_id
    return Failure(503, "route_refused", f"decode worker {d.url} restarted: the route was "
                   "signed for its last instance", retriable=True)


def _prefill_outcome(metrics: RouterMetrics, p: Worker, d: Worker, res: PrefillResult,
                     request_id: str, deadline: Deadline) -> Response | Failure:
    if res.status == PEER_FAULT and not res.client_caused:  # P is fine; D failed the pair
        if deadline.client_expired():  # D gave up on the client's timeout
            record(d, None, metrics, "timeout")
            return _client_timeout()
        d.circuit.record(False)
        metrics.worker_error("decode", "peer_fault")
        return _upstream_failure("decode", d, res.status, b"(reported by prefill " +
                                 p.url.encode() + b") " + res.body, pair=True)
    if res.client_caused and res.status is None:
        return _client_timeout()
    if res.status is None:
        return Failure(502, "prefill_transport_error",
                       f"prefill worker {p.url} failed: {res.error}", retriable=True)
    if res.status in RETRY_STATUSES and not res.client_caused:
        return _upstream_failure("prefill", p, res.status, res.body)
    return Response(res.body, res.status, media_type=res.content_type,
                    headers={"x-request-id": request_id, **res.headers})


def _start_prefill(
    clients: UpstreamClients, metrics: RouterMetrics, p: Worker, url: str, content: bytes,
    headers: dict[str, str], *, deadline: Deadline, on_ok: Callable[[], object],
) -> asyncio.Task[PrefillResult]:
    p.in_flight += 1
    task = asyncio.get_running_loop().create_task(
        call_prefill(clients.get(p), p, url, content, headers, deadline, metrics=metrics))

    def _done(t: asyncio.Task[PrefillResult], worker: Worker = p) -> None:
        worker.in_flight -= 1
        if not t.cancelled() and t.exception() is None and t.result().ok:
            on_ok()  # P sent the KV: the pair works (router/pairs.py)

    task.add_done_callback(_done)
    return task


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        prefill_policy: Policy,
        decode_policy: Policy,
        clients: UpstreamClients,
        metrics: RouterMetrics,
        *, rng: random.Random | None = None,
    ) -> None:
        self._cfg = config
        self._registry = registry
        self._policies = {"prefill": prefill_policy, "decode": decode_policy}
        self._clients = clients
        self._metrics = metrics
        metrics.bind(registry, {"prefill": config.effective_prefill_policy,
                                "decode": config.effective_decode_policy})
        self._rng = rng or random.Random()
        # set by the router when it registers prefill addresses with decode workers (it has
        # no cluster secret to sign routes with): re-registers with one that refused a route
        # True: D was told the prefill addresses again (retry); False: it could not be
        self.on_route_refused: Callable[[Worker], Awaitable[bool]] | None = None
        # before a route goes to a decode worker: make sure it trusts our prefill workers
        # (peering.TrustSync.ensure; None when the router signs its routes)
        self.before_decode: Callable[[Worker], Awaitable[object]] | None = None
        self._dp = DPRanks(config.prefill_round_robin_balance)
        self._background: set[asyncio.Task[PrefillResult]] = set()
        self._prober = Prober(clients, stall_s=config.migration_stall_secs,
                              probe_s=config.health_check_timeout_secs)
        self.pairs = metrics.pairs = PairCircuits(
            config.pair_cb_failure_threshold, config.pair_cb_success_threshold,
            config.pair_cb_timeout_duration_secs, enabled=config.pair_circuit_enabled)
        registry.add_remove_listener(self.pairs.forget)

    def select_pair(self, text: str,
                    avoid: Collection[PairKey] = ()) -> tuple[Worker, Worker] | str:
        """A (P, D) pair (open pair circuits and `avoid` last: router/pairs.py), or why none."""
        pair = self.pairs.choose(self._registry, self._policies, text, avoid)
        if not isinstance(pair, str):
            self._metrics.selected("prefill"), self._metrics.selected("decode")
        return pair

    def backoff_s(self, retry: int) -> float:
        cfg = self._cfg
        base = cfg.retry_initial_backoff_ms * cfg.retry_backoff_multiplier ** (retry - 1)
        base = min(base, cfg.retry_max_backoff_ms)
        jitter = self._rng.uniform(-cfg.retry_jitter_factor, cfg.retry_jitter_factor)
        return max(0.0, base * (1 + jitter)) / 1000

    async def handle(self, route: str, request: Request) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"pdr-{uuid.uuid4().hex}"
        with tracing.remote_parent(request.headers), tracing.span(  # --enable-trace
                "router", {"http.route": route, "pdserve.request_id": request_id}, server=True):
            response = await self._handle(route, request, request_id)
        model, stream = getattr(request.state, "model_stream", ("default", False))
        self._metrics.observe_request(route, response.status_code, time.perf_counter() - started,
                                      model=model, stream=stream, code=error_code(response))
        return response

    async def _handle(self, route: str, request: Request, request_id: str) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise InvalidRequestError("the request body must be a JSON object")
            n = batch_size(route, body)
        except (ValueError, InvalidRequestError) as exc:
            return error_response(400, "invalid_request", f"bad request body: {exc}", request_id)
        stream = bool(body.get("stream"))
        request.state.model_stream = (str(body.get("model") or "default"), stream)  # metrics
        logprobs = wants_logprobs(route, body)
        text = routing_text(route, body)
        headers = {"content-type": "application/json"}
        headers.update({h: v for h in FORWARD_HEADERS if (v := request.headers.get(h))})
        headers.update(tracing.inject())  # traceparent: P's and D's spans join the router's
        loop = asyncio.get_running_loop()
        deadline = request_deadline(body, self._cfg.request_timeout_secs)
        async def resume(sent: dict) -> DecodeLeg | bytes:  # a moved stream's next leg
            gone = loop.create_future()  # the stream watches the client itself
            out = await self._attempts(route, sent, None, True, False, text, headers=headers,
                                       deadline=deadline, request_id=request_id, gone=gone,
                                       migration=LEG_ONLY)
            return out if isinstance(out, DecodeLeg) else bytes(out.body)
        body, mig = mover(route, body, n, stream, logprobs, resume, prober=self._prober,
                          metrics=self._metrics, deadline=deadline,
                          max_moves=self._cfg.migration_max)
        gone = loop.create_task(_client_gone(request))
        try:
            return await self._attempts(route, body, n, stream, logprobs, text, headers=headers,
                                        deadline=deadline, request_id=request_id, gone=gone,
                                        migration=mig)
        finally:  # a committed stream watches for the disconnect itself (one receiver only)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)

    async def _attempts(
        self, route: str, body: dict, n: int | None, stream: bool, logprobs: bool, text: str,
        *, headers: dict[str, str], deadline: Deadline, request_id: str, gone: asyncio.Future[None],
        migration: Migration | str | None = None,
    ) -> Response | DecodeLeg:
        failure: Failure | None = None
        failed_pairs: set[PairKey] = set()  # this request's retries try other pairings first
        for attempt in range(self._cfg.max_attempts):
            if attempt:
                self._metrics.retry(_failed_role(failure), route)
                await asyncio.sleep(min(self.backoff_s(attempt), deadline.left()))
            if deadline.left() <= 0:
                break
            pair = self.select_pair(text, failed_pairs)
            if isinstance(pair, str):
                last = f"; last error: {failure.message}" if failure else ""
                return error_response(
                    503, "server_selection_failed", f"No available servers: {pair}{last}", request_id
                )
            p, d = pair
            if self.before_decode is not None:
                await self.before_decode(d)
            content = json.dumps(inject_bootstrap({**body, **self._dp.fields(p, d)}, p, n,
                                                  self._cfg.route_key, d.server_id)).encode()
            ticket, outcome = self.pairs.begin(p, d), None
            try:
                outcome = await self._attempt(
                    route, p, d, content, headers, stream, logprobs=logprobs, deadline=deadline,
                    request_id=request_id, gone=gone, migration=migration,
                    echo=route == "/v1/completions" and bool(body.get("echo")))
            finally:  # also when cancelled: a half-open pair's trial slot is freed
                if self.pairs.end(ticket, *_pair_outcome(outcome)) is False:
                    failed_pairs.add(ticket.key)
            if isinstance(outcome, (Response, DecodeLeg)):
                return outcome
            failure = outcome
            log.warning("attempt %d for %s failed: %s", attempt + 1, route, failure.message)
            if not failure.retriable:
                break
        else:
            if failure is not None and failure.retriable:
                self._metrics.exhausted(_failed_role(failure), route)
        if failure is None:
            failure = (_client_timeout() if deadline.client_expired() else
                       Failure(504, "request_timeout", "request deadline passed before an attempt",
                               False))
        return error_response(failure.status, failure.code, failure.message, request_id)

    async def _attempt(
        self, route: str, p: Worker, d: Worker, content: bytes, headers: dict[str, str],
        stream: bool, *, logprobs: bool, deadline: Deadline, request_id: str,
        gone: asyncio.Future[None], echo: bool = False, migration: Migration | str | None = None,
    ) -> Response | DecodeLeg | Failure:
        loop = asyncio.get_running_loop()
        p_task = _start_prefill(self._clients, self._metrics, p, p.url + route, content,
                                headers, deadline=deadline, on_ok=lambda: self.pairs.ok(p, d))
        leg = DecodeLeg(d, self._metrics)
        d_task = loop.create_task(
            leg.open(self._clients.get(d), d.url + route, content, headers, deadline, first_only=stream)
        )
        committed = False
        frozen = loop.create_task(self._prober.frozen(d))  # D stops answering: retry elsewhere
        try:
            pending: set[asyncio.Task[object]] = {p_task, d_task, gone, frozen}  # type: ignore
            while True:
                if frozen.done():
                    return Failure(502, "decode_frozen", f"decode worker {d.url} stopped "
                                   "answering (its /health too)", retriable=True)
                if gone.done():  # the finally below cancels both legs: P and D free the room
                    self._metrics.worker_error("client", "disconnect")
                    log.info("client went away before the response started; aborting both legs")
                    return Failure(CLIENT_GONE, "client_disconnected", "client disconnected",
                                   retriable=False)
                if p_task.done() and not p_task.result().ok and not (
                        p_task.result().status == 403 and
                        DECODE_REFUSED_BYTES in p_task.result().body):
                    # (P's 403 saying D refused the route: D's own answer decides, below)
                    # D's whole answer, or a stream that is past its first event, came without
                    # needing P's answer; before that, D waits for KV that will never come
                    d_ok = d_task.done() and d_task.exception() is None and leg.ok and (
                        not stream or leg.flowing)
                    if logprobs or not d_ok:
                        return _prefill_outcome(self._metrics, p, d, p_task.result(), request_id,
                                            deadline)
                if d_task.done():
                    if d_task.exception() is not None:
                        if leg.client_caused:
                            return _client_timeout()
                        exc = d_task.exception()
                        return Failure(502, "decode_transport_error",
                                       f"decode worker {d.url} failed: {exc}", retriable=True)
                    if not leg.ok:
                        if leg.status == 403 and self.on_route_refused is not None and \
                                code_of(leg.body) == ErrorCode.ROUTE_REFUSED and \
                                await self.on_route_refused(d):
                            # D lost the prefill addresses we told it (it restarted): we told
                            # it again, retry; nobody's fault, no circuit counts it. When D
                            # cannot be told (no admin key), its 403 and reason go to the client
                            self._metrics.worker_error("decode", "route_refused")
                            return Failure(503, "route_refused", f"decode worker {d.url} did "
                                           "not trust the route yet", retriable=True)
                        if self._cfg.route_key is not None and (f := _resigned(leg, d)):
                            self._metrics.worker_error("decode", "route_refused")
                            return f
                        if leg.client_caused and leg.status != PEER_FAULT:  # as D answered
                            return Response(leg.body, leg.status, media_type=leg.content_type,
                                            headers={"x-request-id": request_id, **leg.headers})
                        if leg.status == PEER_FAULT:  # D is fine; its prefill peer failed
                            if deadline.client_expired():  # P gave up on the client's timeout
                                record(p, None, self._metrics, "timeout")
                                return _client_timeout()
                            gone_p = code_of(leg.body) == ErrorCode.PEER_RESTARTED  # not P now
                            if not gone_p:
                                p.circuit.record(False)
                            self._metrics.worker_error("prefill", ("peer_restarted" if gone_p
                                                                   else "peer_fault"))
                            return _upstream_failure("prefill", p, leg.status, b"(reported by "
                                                     b"decode " + d.url.encode() + b") " +
                                                     leg.body, pair=not gone_p)
                        if leg.status in RETRY_STATUSES:
                            return _upstream_failure("decode", d, leg.status, leg.body)
                        return Response(leg.body, leg.status, media_type=leg.content_type,
                                        headers={"x-request-id": request_id})
                    if stream and not logprobs and not p_task.done() and not leg.flowing:
                        # a stream's first event may come before the KV (a chat stream's role
                        # chunk): commit once D streams on or P answers well, whichever is first;
                        # until then a failed P is retried, not a stream left hanging (#32)
                        more = leg.read_next()
                        if more.done() and more.exception() is not None:
                            return Failure(502, "decode_transport_error", f"decode worker "
                                           f"{d.url} failed: {more.exception()}", retriable=True)
                        pending.add(more)  # type: ignore[arg-type]
                    elif not logprobs or p_task.done():
                        break
                done, pending = await asyncio.wait(
                    pending, timeout=deadline.left(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:
                    return _client_timeout() if deadline.client_expired() else Failure(
                        504, "request_timeout", f"no answer within --request-timeout-secs "
                        f"({self._cfg.request_timeout_secs:g} s)", retriable=False)
            committed = True
        finally:
            frozen.cancel()
            if not committed:  # to its end even under a cancel (a resume inside a stream)
                await finish(_drop_legs(p_task, d_task, leg))
        return await self._commit(p_task, leg, stream, logprobs, deadline, request_id, echo=echo,
                                  migration=migration)

    async def _commit(
        self, p_task: asyncio.Task[PrefillResult], leg: DecodeLeg, stream: bool, logprobs: bool,
        deadline: Deadline, request_id: str, *, echo: bool = False,
        migration: Migration | str | None = None,
    ) -> Response | DecodeLeg:
        found: dict[int, list[object]] = {}
        if logprobs and echo and not stream:  # /v1/completions: P's prompt logprobs first
            merged = merge_echo_json(leg.body, prefill_echo_logprobs(p_task.result().body))
            if merged is not None:
                await leg.release()
                return Response(merged, leg.status, media_type="application/json",
                                headers={"x-request-id": request_id})
        echo_stream = logprobs and echo and stream
        if echo_stream:  # /v1/completions streamed: P's echo chunk fills D's
            found = prefill_echo_stream(p_task.result().body)
        elif logprobs:
            found = prefill_input_logprobs(p_task.result().body, streamed=stream)
        elif not p_task.done():
            self._background.add(p_task)
            p_task.add_done_callback(self._background.discard)
        if migration == LEG_ONLY:  # a resumed leg (migrate.py): the stream goes on through it
            return leg
        headers = {"x-request-id": request_id}
        if not stream:
            merged = merge_json(leg.body, found) if found else None
            await leg.release()
            if merged is not None:
                return Response(merged, leg.status, media_type="application/json", headers=headers)
            return Response(leg.body, leg.status, media_type=leg.content_type, headers=headers)
        merger = (EchoSSEMerger if echo_stream else SSEMerger)(found) if found else None
        if isinstance(migration, Migration):  # the first leg's merger serves every leg
            return LegResponse(migration.stream(leg, merger), migration, status_code=leg.status,
                                media_type=leg.content_type or "text/event-stream",
                                headers=headers)
        return LegResponse(
            leg.stream(merger, deadline), leg, status_code=leg.status,
            media_type=leg.content_type or "text/event-stream", headers=headers,
        )

    async def close(self) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._clients.aclose()
