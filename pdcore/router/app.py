"""The router's FastAPI application.

1. `create_app(config)` validates the config and builds the state that needs no I/O: worker
   registry (every CLI worker registered, not yet healthy), one policy per role, metrics.
2. Lifespan start: one shared httpx.AsyncClient; each worker gets a startup health watch and the
   periodic health (and, for power_of_two, load) tasks start. The server listens at once; a role
   without a healthy worker yields 503 `server_selection_failed`, and `/health` answers 503 until
   every worker is healthy. `--mini-lb` skips all of this: workers count as healthy from the start.
3. Requests: generation routes go through `proxy.Proxy`; admin and info routes live in `admin.py`.
   `--api-key` and the admin-route guard are the servers' (`pdcore.edge.auth`): the routes
   that change the router's state need `--admin-api-key`, and are off without one.
4. Lifespan end: background prefill drains and monitor tasks are cancelled, the client closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdcore.edge import tracing
from pdcore.edge.auth import install_auth, log_admin_policy
from pdcore.edge.limits import install_limits
from pdcore.router.admin import build_admin_router
from pdcore.router.client_limit import PerClientLimit
from pdcore.router.config import RouterConfig
from pdcore.router.dashboard import build_dashboard_router
from pdcore.router.discovery import ServiceDiscovery
from pdcore.router.fleet import RouterFleet
from pdcore.router.health import HealthMonitor
from pdcore.router.peering import TrustSync
from pdcore.router.policies import make_policy
from pdcore.router.proxy import Proxy
from pdcore.router.state import RouterState
from pdcore.router.upstream import UpstreamClients
from pdcore.router.workers import WorkerRegistry

log = logging.getLogger("pdcore.router")

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
# answered without --api-key: supervisors probe /health; the dashboard page holds no data (it
# asks for the key and sends it on each poll)
OPEN_PATHS = ("/health", "/dashboard")


def build_state(config: RouterConfig) -> RouterState:
    config.validate()
    registry = WorkerRegistry(config)
    policies = {
        "prefill": make_policy(config.effective_prefill_policy, config),
        "decode": make_policy(config.effective_decode_policy, config),
    }
    for policy in policies.values():
        registry.add_remove_listener(policy.forget)
    for url, bootstrap_port in config.prefill:
        registry.add(url, "prefill", bootstrap_port, healthy=config.mini_lb)
    for url in config.decode:
        registry.add(url, "decode", healthy=config.mini_lb)
    return RouterState(config, registry, policies)


def create_app(config: RouterConfig) -> FastAPI:
    """The router app; raises ConfigError on an invalid config."""
    state = build_state(config)
    if config.enable_trace:  # OpenTelemetry (edge/tracing.py): the router's span is the root
        tracing.setup("pdserve-router", config.otlp_traces_endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # This client serves health checks and admin calls; the data path has per-worker ones.
        client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_secs, connect=10.0),
                                   headers=config.worker_headers(), verify=config.upstream_ssl())
        needs_loads = any(p.needs_loads for p in state.policies.values())
        monitor = HealthMonitor(config, state.registry, client, poll_loads=needs_loads)
        state.client, state.monitor = client, monitor
        state.proxy = Proxy(
            config, state.registry, state.policies["prefill"], state.policies["decode"],
            UpstreamClients(headers=config.worker_headers(), verify=config.upstream_ssl()),
            state.metrics,
        )
        if config.prometheus_port is not None:
            from prometheus_client import start_http_server

            start_http_server(
                config.prometheus_port, addr=config.prometheus_host, registry=state.metrics.registry
            )
        if config.mini_lb:
            log.warning("mini-lb mode: random pairs, no health checks, retries or circuits")
        else:
            for worker in state.registry:
                monitor.watch_startup(worker)
            monitor.start()
        if config.service_discovery:
            state.discovery = ServiceDiscovery(config, state.registry, monitor)
            state.discovery.start(asyncio.get_running_loop())
        if config.route_key is None:
            log.warning("no cluster secret (--disaggregation-auth-token): routes go unsigned; "
                        "the router registers its prefill workers' bootstrap addresses with its "
                        "decode workers, which accept only those")
            if not config.admin_api_key:
                log.warning("no cluster secret and no --admin-api-key: the router cannot "
                            "register its prefill workers with its decode workers (an admin "
                            "call), so they will refuse its routes with 403 unless each lists "
                            "them with --disaggregation-trusted-prefill. Give router and "
                            "servers the same cluster secret (best) or the same admin key")
            state.peering = TrustSync(config, state.registry, client)
            state.peering.start()
            state.proxy.on_route_refused = state.peering.sync
            state.proxy.before_decode = state.peering.ensure
        else:
            log.info("routes are signed with the cluster secret")
        if config.peer_routers:  # one of several routers: a peer's worker list, then listen
            state.fleet = RouterFleet(config, state.registry, client, monitor)
            await state.fleet.join()
            state.fleet.sync.seed()
            state.fleet.sync.start()
        try:
            yield
        finally:
            if state.peering is not None:
                await state.peering.stop()
            if state.fleet is not None:
                await state.fleet.sync.stop()
            if state.discovery is not None:
                state.discovery.stop()
            await state.proxy.close()
            await monitor.stop()
            await client.aclose()
            tracing.shutdown()  # the spans still queued go out

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.router = state
    install_limits(app)  # early 413 and the same field checks as the servers, before any worker
    app.add_middleware(PerClientLimit, limit=config.max_concurrent_requests_per_client,
                       paths=GENERATION_ROUTES, counter=state.metrics.client_refused)
    # The router's own calls to workers carry the same key (RouterConfig.worker_headers), and a
    # client's header, forwarded with a generate request, is that key once it passed here.
    install_auth(app, config.api_key, config.admin_api_key, OPEN_PATHS)

    def _make_route(route: str):  # type: ignore[no-untyped-def]
        async def generate(request: Request) -> Response:
            assert state.proxy is not None  # set by lifespan before serving
            return await state.proxy.handle(route, request)

        return generate

    for route in GENERATION_ROUTES:
        app.add_api_route(route, _make_route(route), methods=["POST"])

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when every registered worker is healthy (as sglang-router); else 503."""
        if state.registry.all_healthy():
            return JSONResponse({"status": "ok"})
        bad = [w.url for w in state.registry if not w.healthy]
        status = "starting" if any(w.starting for w in state.registry) else "unhealthy"
        return JSONResponse({"status": status, "unhealthy_workers": bad}, status_code=503)

    @app.get("/readiness")
    async def readiness() -> JSONResponse:
        """200 when at least one prefill and one decode worker are available."""
        body = {
            "ready": state.registry.ready(),
            "available_prefill": len(state.registry.available("prefill")),
            "available_decode": len(state.registry.available("decode")),
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/liveness")
    async def liveness() -> JSONResponse:
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def metrics() -> Response:
        data = state.metrics.render(state.registry)
        return Response(data, media_type=state.metrics.content_type)

    @app.get("/service_discovery")
    async def service_discovery() -> JSONResponse:
        """What the Kubernetes watchers saw per role (404 without --service-discovery)."""
        if state.discovery is None:
            return JSONResponse({"error": {"code": "not_enabled", "message":
                                 "start the router with --service-discovery"}}, status_code=404)
        return JSONResponse(state.discovery.snapshot())

    app.include_router(build_admin_router(state))
    app.include_router(build_dashboard_router(state))
    log_admin_policy(app, log)
    return app
