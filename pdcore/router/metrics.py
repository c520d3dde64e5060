"""Prometheus metrics of one router instance (own registry, so several routers can share a process).

Names, types and labels are sglang-router's (0.3.x, `smg_*`: read from its /metrics in PD
mode), so its dashboards work against ours; what it has no name for is `pdrouter_*`.
docs/metrics.md lists them. Request series are updated by the proxy as requests finish;
per-worker series (requests in flight, health, circuit state and outcomes, polled load) are
built from the registry at scrape time, so a removed worker disappears from the next scrape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdcore.router.circuit import CircuitState
from pdcore.router.pairs import PairCircuits
from pdcore.router.workers import WorkerRegistry

_CIRCUIT_CODE = {CircuitState.CLOSED: 0, CircuitState.OPEN: 1, CircuitState.HALF_OPEN: 2}
# sglang-router's default buckets
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 45, 60, 90,
            120, 180, 240)
# constant labels of a PD router speaking HTTP to its workers, as sglang-router sets them
ROUTER = {"router_type": "http", "backend_type": "pd", "connection_mode": "http"}
_ENDPOINTS = {"/generate": "generate", "/v1/chat/completions": "chat",
              "/v1/completions": "completions", "/v1/responses": "responses"}


def endpoint(route: str) -> str:
    return _ENDPOINTS.get(route, route.strip("/").replace("/", "_") or "root")


def error_code(response: Any) -> str:
    """The `error.code` of an error answer's JSON body ('' when there is none)."""
    if getattr(response, "status_code", 200) < 400:
        return ""
    try:
        err = json.loads(getattr(response, "body", b"") or b"{}").get("error")
    except (ValueError, AttributeError):
        return ""
    return str(err.get("code") or "") if isinstance(err, dict) else ""


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` gauge beside every counter
        self.policies: dict[str, str] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        route = [*ROUTER, "model", "endpoint"]
        self.client_refused = Counter(
            "pdrouter_client_requests_refused", "Generate requests refused with 429: their "
            "client had --max-concurrent-requests-per-client in flight", registry=r)
        self.http_requests = Counter("smg_http_requests", "Total HTTP requests by method and "
                                     "path", ["method", "path"], registry=r)
        self.http_responses = Counter("smg_http_responses", "Total HTTP responses by status_code"
                                      " and error_code", ["status_code", "error_code"], registry=r)
        self.http_duration = Histogram("smg_http_request_duration_seconds", "HTTP request "
                                       "duration by method and path (to the response head)",
                                       ["method", "path"], buckets=_BUCKETS, registry=r)
        self.requests = Counter("smg_router_requests", "Total routed requests by router_type, "
                                "backend_type, connection_mode, model, endpoint, streaming",
                                [*route, "streaming"], registry=r)
        self.duration = Histogram("smg_router_request_duration_seconds", "Router request "
                                  "duration by router_type, backend_type, connection_mode, "
                                  "model, endpoint", route, buckets=_BUCKETS, registry=r)
        self.errors = Counter("smg_router_request_errors", "Router errors by router_type, "
                              "backend_type, connection_mode, model, endpoint, error_type",
                              [*route, "error_type"], registry=r)
        self.selections = Counter("smg_worker_selection", "Worker selection events by "
                                  "worker_type, connection_mode, model, policy",
                                  ["worker_type", "connection_mode", "model", "policy"],
                                  registry=r)
        self.retries = Counter("smg_worker_retries", "Total retry attempts by worker_type and "
                               "endpoint", ["worker_type", "endpoint"], registry=r)
        self.retries_exhausted = Counter("smg_worker_retries_exhausted", "Requests that "
                                         "exhausted all retries by worker_type and endpoint",
                                         ["worker_type", "endpoint"], registry=r)
        self.worker_errors = Counter("smg_worker_errors", "Worker-level errors by worker_type, "
                                     "connection_mode, error_type",
                                     ["worker_type", "connection_mode", "error_type"], registry=r)
        self.migrations = Counter(
            "pdrouter_migrations", "Streams moved to another pair mid-stream (router/migrate.py) "
            "by reason (broken, stalled, error_event) and outcome (resumed, failed, gave_up)",
            ["reason", "outcome"], registry=r)
        self.migration_resume = Histogram(
            "pdrouter_migration_resume_seconds", "From a stream's break to the first event of "
            "its resumed leg", buckets=_BUCKETS, registry=r)
        self._workers: WorkerRegistry | None = None
        self.pairs: PairCircuits | None = None  # the proxy's pair circuits (router/pairs.py)
        r.register(_WorkerCollector(self))

    def bind(self, workers: WorkerRegistry, policies: dict[str, str]) -> None:
        """The registry per-worker series are read from (every scrape, on either port) and the
        policy of each role."""
        self._workers, self.policies = workers, dict(policies)

    # -- recorded by the proxy -----------------------------------------------------------------
    def observe_request(self, route: str, status: int, seconds: float, *, model: str = "default",
                        stream: bool = False, code: str = "") -> None:
        ep = endpoint(route)
        self.http_requests.labels("POST", route).inc()
        self.http_duration.labels("POST", route).observe(seconds)
        self.http_responses.labels(str(status), code).inc()
        self.requests.labels(*ROUTER.values(), model, ep, str(stream).lower()).inc()
        self.duration.labels(*ROUTER.values(), model, ep).observe(seconds)
        if status >= 400:
            self.errors.labels(*ROUTER.values(), model, ep, code or str(status)).inc()

    def selected(self, worker_type: str, model: str = "default") -> None:
        self.selections.labels(worker_type, "http", model,
                               self.policies.get(worker_type, "")).inc()

    def retry(self, worker_type: str, route: str) -> None:
        self.retries.labels(worker_type, endpoint(route)).inc()

    def exhausted(self, worker_type: str, route: str) -> None:
        self.retries_exhausted.labels(worker_type, endpoint(route)).inc()

    def migration(self, reason: str, outcome: str) -> None:
        self.migrations.labels(reason, outcome).inc()

    def migration_resumed(self, seconds: float) -> None:
        self.migration_resume.observe(seconds)

    def worker_error(self, worker_type: str, kind: str) -> None:
        self.worker_errors.labels(worker_type, "http", kind).inc()

    def render(self, workers: WorkerRegistry) -> bytes:
        if self._workers is None:
            self._workers = workers
        return generate_latest(self.registry)


class _WorkerCollector:
    """Per-worker series from the registry the last render() was given."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._m = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        workers = list(self._m._workers or [])
        per_worker = {
            "smg_worker_requests_active": "Currently running requests per worker",
            "smg_worker_health": "Worker health status (1=healthy, 0=unhealthy)",
            "smg_worker_cb_state": "Circuit breaker state per worker (0=closed, 1=open, "
                                   "2=half_open)",
            "smg_worker_cb_consecutive_failures": "Current consecutive failure count per worker",
            "smg_worker_cb_consecutive_successes": "Current consecutive success count per "
                                                   "worker"}
        fams = {n: GaugeMetricFamily(n, doc, labels=["worker"]) for n, doc in per_worker.items()}
        outcomes = CounterMetricFamily("smg_worker_cb_outcomes", "Circuit breaker outcomes by "
                                       "worker and outcome (success/failure/client_error)",
                                       labels=["worker", "outcome"])
        load = GaugeMetricFamily("pdrouter_worker_load_tokens", "Last polled /get_load token "
                                 "count (-1 unknown), by worker and role",
                                 labels=["worker", "worker_type"])
        pool = GaugeMetricFamily("smg_worker_pool_size", "Current worker pool size by "
                                 "worker_type, connection_mode, model",
                                 labels=["worker_type", "connection_mode", "model"])
        sizes = {"prefill": 0, "decode": 0}
        for w in workers:
            cb = w.circuit.snapshot()
            values = {"smg_worker_requests_active": w.in_flight,
                      "smg_worker_health": 1 if w.healthy else 0,
                      "smg_worker_cb_state": _CIRCUIT_CODE[w.circuit.state],
                      "smg_worker_cb_consecutive_failures": cb.get("consecutive_failures", 0),
                      "smg_worker_cb_consecutive_successes": cb.get("consecutive_successes", 0)}
            for name, v in values.items():
                fams[name].add_metric([w.key], float(v or 0))  # type: ignore[arg-type]
            outcomes.add_metric([w.key, "success"], float(w.circuit.total_successes))
            outcomes.add_metric([w.key, "failure"], float(w.circuit.total_failures))
            # answers the client caused (circuit.py): counted neither way
            outcomes.add_metric([w.key, "client_error"], float(w.circuit.total_client_errors))
            load.add_metric([w.key, w.worker_type], float(w.load))
            sizes[w.worker_type] = sizes.get(w.worker_type, 0) + 1
        for role, n in sizes.items():
            pool.add_metric([role, "http", "default"], float(n))
        yield from fams.values()
        yield from (outcomes, load, pool)
        if self._m.pairs is not None:
            yield from _pair_metrics(self._m.pairs)


def _pair_metrics(pairs: PairCircuits) -> Iterator[Metric]:
    """The prefill-decode pair circuits (router/pairs.py): how many are open now, each tracked
    pair's state (only pairs of current workers that failed since they last closed), totals."""
    counts = pairs.counts()
    open_now = GaugeMetricFamily("pdrouter_pair_circuits_open", "Prefill-decode pairs avoided "
                                 "now (their pair circuit is open)")
    open_now.add_metric([], float(counts[CircuitState.OPEN.value]))
    state = GaugeMetricFamily("pdrouter_pair_circuit_state", "Pair circuit state of each pair "
                              "that failed since it last closed (0=closed, 1=open, 2=half_open)",
                              labels=["prefill", "decode"])
    for row in pairs.snapshot():
        state.add_metric([str(row["prefill"]), str(row["decode"])],
                         float(_CIRCUIT_CODE[CircuitState(row["state"])]))
    failures = CounterMetricFamily("pdrouter_pair_failures", "Peer-fault reports counted "
                                   "against a prefill-decode pair")
    failures.add_metric([], float(pairs.total_failures))
    opened = CounterMetricFamily("pdrouter_pair_circuit_opened", "Times a pair circuit opened")
    opened.add_metric([], float(pairs.total_opened))
    yield from (open_now, state, failures, opened)
