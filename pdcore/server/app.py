"""FastAPI app factory of one pdserve server.

1. `create_app(args)` builds the app around the engine handle (pdcore.runtime.make_engine:
   not started yet);
2. the lifespan starts the engine in the background, so /health answers 503 while the model
   loads and 200 once the scheduler is ready; `app.state.on_ready` / `on_start_failed`
   (set by the runner) are called when that settles;
3. at shutdown the engine stops and the scheduler process is terminated.

Before /health turns 200 a unified server runs a one-token warm-up generate (the first forward
pass pays for lazy initialisation; `--skip-server-warmup` skips it). PD servers skip it: a
generate there needs a peer. With `--api-key` every route but /health answers 401 without
`Authorization: Bearer <key>`; the admin routes (cache flush, profiling, trusted prefill
changes) answer only `--admin-api-key`, and are off without one (`pdcore.edge.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders

from pdcore.config import ServerArgs
from pdcore.edge import tracing
from pdcore.edge.auth import install_auth, log_admin_policy
from pdcore.edge.limits import install_limits
from pdcore.env import ENV
from pdcore.route_auth import SERVER_ID_HEADER, RouteGuard
from pdcore.runtime import (
    EngineError,
    EngineHandle,
    SchedulerTarget,
    lower_own_priority,
    make_engine,
)
from pdcore.route_refusal import RefusalNotifier
from pdcore.server import (
    admin_routes,
    native_routes,
    openai_routes,
    pd_trust_routes,
    responses_routes,
)
from pdcore.server.drain import Drain, DrainMiddleware, drain_timeout
from pdcore.server.http_errors import install_error_handlers
from pdcore.server.metrics import ServerMetrics, metrics_engine_type, metrics_model_name
from pdcore.server.params import PDInfo
from pdcore.server.planner import plan_probe

log = logging.getLogger(__name__)

GENERATE_ROUTES = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"}
OPEN_PATHS = frozenset({"/health"})  # answered without --api-key: supervisors probe it
WARMUP_TIMEOUT_S = 120.0


async def _warm_up(engine: EngineHandle) -> None:
    """One greedy token through the scheduler (each DP replica's), before the server reports
    ready."""
    t0 = time.monotonic()
    for rank in range(engine.args.dp_size):
        pd = PDInfo(routed_dp_rank=rank if engine.args.dp_size > 1 else None)
        req = plan_probe(f"warmup-{uuid.uuid4().hex[:8]}", list(range(4)), engine, pd)
        async with contextlib.aclosing(engine.generate(req, timeout=WARMUP_TIMEOUT_S)) as outs:
            async for _ in outs:
                pass
    log.info("warm-up generate done in %.0f ms", (time.monotonic() - t0) * 1000)


class RequestHeaders:
    """Pure ASGI (a stream's chunks pass straight through; `@app.middleware("http")` would
    relay each through a memory stream and a task of its own): echoes `x-request-id` (routers
    correlate logs with it), adds the server id a PD router signs routes for, and counts the
    generate routes' answers by status."""

    def __init__(self, app: Any, args: ServerArgs, metrics: ServerMetrics) -> None:
        self.app, self.args, self.metrics = app, args, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get("x-request-id")
        path, args = scope.get("path"), self.args

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if rid and "x-request-id" not in headers:
                    headers["x-request-id"] = rid
                if args.disaggregation_mode != "null":
                    headers[SERVER_ID_HEADER] = args.server_id
                if path in GENERATE_ROUTES:
                    self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _lower_http_priority() -> None:
    """PDSERVE_HTTP_NICE: this process's threads yield the cores to its engine's (docs/cpu.md)."""
    by = ENV.pdserve_http_nice
    if by > 0:
        n = lower_own_priority(by)
        log.info("HTTP process: %d threads at nice +%d (PDSERVE_HTTP_NICE)", n, by)


async def _start_engine(app: FastAPI) -> None:
    engine: EngineHandle = app.state.engine
    args: ServerArgs = app.state.args
    try:
        await engine.start()
        _lower_http_priority()
        if args.skip_server_warmup:
            log.info("warm-up skipped (--skip-server-warmup)")
        elif args.disaggregation_mode != "null":
            log.info("warm-up skipped: a %s server needs a peer to generate",
                     args.disaggregation_mode)
        else:
            app.state.warming_up = True
            try:
                await _warm_up(engine)
            finally:
                app.state.warming_up = False
    except EngineError as e:
        log.error("engine failed to start: %s", e)
        cb = getattr(app.state, "on_start_failed", None)
        if cb is not None:
            cb(e)
        return
    log.info("engine ready: %s", engine.info.model_path)
    cb = getattr(app.state, "on_ready", None)
    if cb is not None:
        cb(engine)


def create_app(args: ServerArgs, *, engine: EngineHandle | None = None,
               scheduler_target: SchedulerTarget | None = None, tokenizer: Any = None,
               **engine_kwargs: Any) -> FastAPI:
    """The app for one server. `scheduler_target` / `tokenizer` replace the real scheduler
    process function and tokenizer (tests)."""
    engine = engine or make_engine(args, scheduler_target=scheduler_target, tokenizer=tokenizer,
                                   **engine_kwargs)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starter = asyncio.create_task(_start_engine(app), name="pdserve-engine-start")
        try:
            yield
        finally:
            await engine.shutdown()
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            tracing.shutdown()  # the spans still queued go out
            if app.state.refusal_notifier is not None:
                await asyncio.to_thread(app.state.refusal_notifier.close)

    if args.enable_trace:  # OpenTelemetry (edge/tracing.py)
        tracing.setup(f"pdserve-{metrics_engine_type(args)}", args.otlp_traces_endpoint)
    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.add_middleware(tracing.TraceMiddleware)
    app.state.engine = engine
    app.state.args = args
    app.state.metrics = ServerMetrics(metrics_model_name(args), metrics_engine_type(args))
    app.state.on_ready = None
    app.state.on_start_failed = None
    app.state.warming_up = False
    app.state.drain = Drain(drain_timeout(args.drain_timeout))
    app.state.route_guard = RouteGuard(
        args.disaggregation_auth_token, args.disaggregation_trusted_prefill,
        args.disaggregation_bootstrap_port if args.disaggregation_mode == "prefill" else None,
        decode_id=args.server_id if args.disaggregation_mode == "decode" else None)
    app.state.refusal_notifier = None
    if args.disaggregation_mode == "decode":  # tell P at once when a route is refused
        notices = app.state.metrics.refusal_notices
        notifier = RefusalNotifier.from_env(args.disaggregation_auth_token,
                                            lambda result: notices.labels(result).inc())
        if notifier is not None:
            app.state.route_guard.on_refused = notifier.notify
            app.state.refusal_notifier = notifier
    install_error_handlers(app)
    install_limits(app)
    # outside auth: a draining server refuses before anything else looks at the request
    app.add_middleware(DrainMiddleware, drain=app.state.drain, routes=GENERATE_ROUTES)

    install_auth(app, args.api_key, args.admin_api_key, OPEN_PATHS)

    app.add_middleware(RequestHeaders, args=args, metrics=app.state.metrics)

    app.include_router(native_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(admin_routes.router)
    if args.disaggregation_mode != "null":
        app.include_router(pd_trust_routes.router)
        pd_trust_routes.log_trust_policy(app.state.route_guard, args.disaggregation_mode, log)
    log_admin_policy(app, log)
    return app
