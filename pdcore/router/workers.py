"""Worker registry: the prefill and decode workers the router knows, and their live state.

A worker is *available* (selectable by a policy) when it is healthy and its circuit is not open.
Health is driven by `health.HealthMonitor` (which also probes a worker at once after a failed
request, and a down worker every fraction of a second until it is back); circuits by the
proxy's outcomes; `in_flight` counts
the router's own requests on the worker; `load` is the last `/get_load` token count (-1 unknown).

`--dp-aware` (sglang-router's meaning): once a server with `dp_size` N > 1 turns healthy, its
entry becomes N entries, one per DP rank (`key` URL@rank; `url` stays the server's, where
requests, health checks and load polls go), so policies choose a DP rank, each with its own
load (its `/get_load` entry); the proxy sends the rank along (pdcore.router.policies.dp_fields).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from pdcore.errors import ConfigError
from pdcore.router.circuit import CircuitBreaker
from pdcore.router.config import WORKER_TYPES, RouterConfig, check_port, normalize_url


@dataclass(eq=False)
class Worker:
    url: str
    worker_type: str  # "prefill" | "decode"
    circuit: CircuitBreaker
    bootstrap_port: int | None = None
    healthy: bool = False
    starting: bool = True  # still waiting for its first healthy /health
    health_failures: int = 0
    health_successes: int = 0
    last_health_error: str | None = None
    last_probe_at: float = 0.0  # monotonic start of its last health probe
    in_flight: int = 0
    load: int = -1
    added_at: float = field(default_factory=time.time)
    dp_rank: int | None = None  # --dp-aware: the server's DP rank this entry stands for
    dp_size: int = 1  # the server's, from its /get_server_info (--dp-aware, round robin balance)
    server_id: str = ""  # the server's id, from its answers' x-pdserve-server-id (route_auth)

    @property
    def key(self) -> str:
        """The registry key: the URL, or URL@rank for one DP rank of a server."""
        return self.url if self.dp_rank is None else f"{self.url}@{self.dp_rank}"

    @property
    def bootstrap_host(self) -> str:
        # urlsplit strips IPv6 brackets, which is what the bootstrap client expects.
        return urlsplit(self.url).hostname or ""

    @property
    def available(self) -> bool:
        return self.healthy and self.circuit.allows_requests()

    def effective_load(self) -> int:
        """Polled token load (stale between polls) plus the router's own in-flight requests."""
        return max(self.load, 0) + self.in_flight

    def snapshot(self) -> dict[str, object]:
        out: dict[str, object] = {
            "url": self.key,
            "worker_type": self.worker_type,
            "healthy": self.healthy,
            "starting": self.starting,
            "available": self.available,
            "circuit": self.circuit.snapshot(),
            "in_flight": self.in_flight,
            "load": self.load,
            "last_health_error": self.last_health_error,
        }
        if self.worker_type == "prefill":
            out["bootstrap_port"] = self.bootstrap_port
        if self.dp_size > 1:
            out["dp_size"], out["dp_rank"] = self.dp_size, self.dp_rank
        return out


class WorkerRegistry:
    """Holds workers by URL. All mutation happens on the event loop thread (no locks needed)."""

    def __init__(
        self,
        config: RouterConfig,
        on_remove: Callable[[Worker], None] | None = None,
    ) -> None:
        self._config = config
        self._workers: dict[str, Worker] = {}
        self._on_remove: list[Callable[[Worker], None]] = [on_remove] if on_remove else []

    def add_remove_listener(self, callback: Callable[[Worker], None]) -> None:
        self._on_remove.append(callback)

    def add(
        self,
        url: str,
        worker_type: str,
        bootstrap_port: int | None = None,
        healthy: bool = False,
    ) -> Worker:
        """Register a worker; ConfigError (HTTP 400/409 upstream) on bad or duplicate input."""
        if worker_type not in WORKER_TYPES:
            raise ConfigError(f"worker_type must be 'prefill' or 'decode', got {worker_type!r}")
        url = normalize_url(url, "url")
        if worker_type == "decode" and bootstrap_port is not None:
            raise ConfigError("bootstrap_port applies to prefill workers only")
        check_port(bootstrap_port, "bootstrap_port", allow_none=True)
        same = self._of_url(url)
        if same:
            raise DuplicateWorkerError(
                f"worker {url} is already registered as {same[0].worker_type}; "
                "remove it first to change its type or bootstrap port"
            )
        cfg = self._config
        worker = Worker(
            url=url,
            worker_type=worker_type,
            bootstrap_port=bootstrap_port,
            circuit=CircuitBreaker(
                cfg.cb_failure_threshold,
                cfg.cb_success_threshold,
                cfg.cb_timeout_duration_secs,
                enabled=cfg.circuit_breaker_enabled,
            ),
            healthy=healthy,
            starting=not healthy,
        )
        self._workers[worker.key] = worker
        return worker

    def _of_url(self, key: str) -> list[Worker]:
        """The entry under `key`, else every DP-rank entry of server `key`."""
        exact = self._workers.get(key)
        return [exact] if exact is not None else [
            w for w in self._workers.values() if w.url == key]

    def remove(self, url: str) -> Worker:
        """Remove a worker (a server's URL removes all its DP-rank entries; the first is
        returned)."""
        key = url.strip().rstrip("/")
        workers = self._of_url(key)
        if not workers:
            raise KeyError(f"no worker {key!r} is registered; GET /workers lists them")
        for worker in workers:
            del self._workers[worker.key]
            for callback in self._on_remove:
                callback(worker)
        return workers[0]

    def get(self, url: str) -> Worker | None:
        found = self._of_url(url.strip().rstrip("/"))
        return found[0] if found else None

    def expand(self, worker: Worker, dp_size: int) -> list[Worker]:
        """--dp-aware: replace a server's entry by one healthy entry per DP rank."""
        if self._workers.get(worker.key) is not worker:
            return []
        del self._workers[worker.key]
        for callback in self._on_remove:
            callback(worker)
        out, c = [], worker.circuit
        for rank in range(dp_size):
            circuit = CircuitBreaker(c.failure_threshold, c.success_threshold, c.timeout_s,
                                     enabled=c.enabled)
            w = replace(worker, circuit=circuit, dp_rank=rank, dp_size=dp_size, healthy=True,
                        starting=False)
            self._workers[w.key] = w
            out.append(w)
        return out

    def __contains__(self, worker: object) -> bool:
        return isinstance(worker, Worker) and self._workers.get(worker.key) is worker

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def of_type(self, worker_type: str) -> list[Worker]:
        return [w for w in self._workers.values() if w.worker_type == worker_type]

    def available(self, worker_type: str) -> list[Worker]:
        return [w for w in self.of_type(worker_type) if w.available]

    def all_healthy(self) -> bool:
        workers = list(self._workers.values())
        return bool(workers) and all(w.healthy for w in workers)

    def ready(self) -> bool:
        return bool(self.available("prefill")) and bool(self.available("decode"))

    def snapshot(self) -> dict[str, list[dict[str, object]]]:
        return {t: [w.snapshot() for w in self.of_type(t)] for t in WORKER_TYPES}


class DuplicateWorkerError(ConfigError):
    """A worker URL is registered already (HTTP 409)."""
