"""Prometheus metrics of one router instance (own registry, so several routers can share a process).

Request counters and latency are updated by the proxy as requests finish; per-worker gauges
(in-flight, health, circuit state, polled load) are refreshed from the registry at scrape time.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pdcore.router.circuit import CircuitState
from pdcore.router.workers import WorkerRegistry

_CIRCUIT_CODE = {CircuitState.CLOSED: 0, CircuitState.OPEN: 1, CircuitState.HALF_OPEN: 2}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdrouter_requests_total", "Requests answered, by route and HTTP status",
            ["route", "status"], registry=r,
        )
        self.retries = Counter(
            "pdrouter_retries_total", "Request attempts beyond the first", ["route"], registry=r
        )
        self.upstream_errors = Counter(
            "pdrouter_upstream_errors_total", "Failed worker calls, by role and kind",
            ["worker_type", "kind"], registry=r,
        )
        self.latency = Histogram(
            "pdrouter_request_duration_seconds",
            "Time to the response head (non-stream: whole response), by route",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "pdrouter_worker_in_flight", "Router requests in flight per worker",
            ["worker", "worker_type"], registry=r,
        )
        self.healthy = Gauge(
            "pdrouter_worker_healthy", "1 if the worker passes health checks",
            ["worker", "worker_type"], registry=r,
        )
        self.circuit = Gauge(
            "pdrouter_worker_circuit_state", "Circuit state: 0 closed, 1 open, 2 half-open",
            ["worker", "worker_type"], registry=r,
        )
        self.load = Gauge(
            "pdrouter_worker_load_tokens", "Last polled /get_load token count (-1 unknown)",
            ["worker", "worker_type"], registry=r,
        )

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def render(self, workers: WorkerRegistry) -> bytes:
        for gauge in (self.in_flight, self.healthy, self.circuit, self.load):
            gauge.clear()  # removed workers must disappear from the scrape
        for w in workers:
            labels = {"worker": w.url, "worker_type": w.worker_type}
            self.in_flight.labels(**labels).set(w.in_flight)
            self.healthy.labels(**labels).set(1 if w.healthy else 0)
            self.circuit.labels(**labels).set(_CIRCUIT_CODE[w.circuit.state])
            self.load.labels(**labels).set(w.load)
        return generate_latest(self.registry)
