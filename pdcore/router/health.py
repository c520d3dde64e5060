"""Background health and load monitoring of workers.

1. `watch_startup(worker)`: a new worker (from the CLI or `POST /workers`) is polled on
   `GET <health endpoint>` with growing backoff (0.1 s x1.5, capped at 5 s) until it answers 200
   (-> healthy) or `--worker-startup-timeout-secs` passes (-> left unhealthy, logged; the periodic
   checker keeps probing it). The router listens meanwhile; such a worker is not selectable.
2. `start()`: a periodic task probes every started worker each `--health-check-interval-secs`
   with `--health-check-timeout-secs`; `--health-failure-threshold` consecutive failures mark it
   unhealthy, `--health-success-threshold` consecutive successes mark it healthy again.
   A worker under suspicion (a request to it failed since its last probe, a failure streak in
   progress, or marked unhealthy) is probed every `recovery_period()` (at most 0.5 s) instead:
   a dead worker leaves rotation within a few probes, and one that answers again is back
   within one health interval; a worker that comes back from unhealthy also gets its open
   circuit half-opened at once (its failures were the outage, not a fault of the new process).
   A good probe sent while a worker's circuit is half-open closes the circuit (circuit.py).
3. When a policy needs loads (power_of_two), another task polls `GET /get_load` each
   `--load-check-interval-secs`; the answer is a JSON list of per-DP-rank dicts whose
   `num_tokens` are summed (a dict with `num_tokens` or `load` is accepted too).
4. `stop()`: cancels every task it started and waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pdcore.route_auth import SERVER_ID_HEADER
from pdcore.router.config import RouterConfig
from pdcore.router.upstream import draining
from pdcore.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pdcore.router.health")

RECOVERY_PROBE_S = 0.5  # upper bound on the probe period of a suspect worker


def parse_load(payload: object, dp_rank: int | None = None) -> int:
    """Token load from a `/get_load` answer (one DP rank's with `dp_rank`); -1 when the shape
    is not understood."""
    if dp_rank is not None:
        mine = [item for item in payload if isinstance(item, dict)
                and item.get("dp_rank") == dp_rank] if isinstance(payload, list) else []
        return parse_load(mine) if mine else -1
    if isinstance(payload, list):
        total = 0
        for item in payload:
            if not isinstance(item, dict) or not isinstance(item.get("num_tokens"), (int, float)):
                return -1
            total += int(item["num_tokens"])
        return total
    if isinstance(payload, dict):
        for key in ("num_tokens", "load"):
            if isinstance(payload.get(key), (int, float)):
                return int(payload[key])
    return -1


class HealthMonitor:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        poll_loads: bool,
    ) -> None:
        self._config = config
        self._registry = registry
        self._client = client
        self._poll_loads = poll_loads
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: object, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        self._spawn(self._periodic_health(), "router-health")
        self._spawn(self._periodic_suspects(), "router-health-suspects")
        if self._poll_loads:
            self._spawn(self._periodic_loads(), "router-loads")

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def watch_startup(self, worker: Worker) -> None:
        self._spawn(self._startup(worker), f"router-startup-{worker.url}")

    async def probe(self, worker: Worker) -> bool:
        """One health probe; records the error text on failure."""
        url = worker.url + self._config.health_check_endpoint
        worker.last_probe_at = time.monotonic()
        try:
            resp = await self._client.get(url, timeout=self._config.health_check_timeout_secs)
        except httpx.HTTPError as exc:
            worker.last_health_error = f"{type(exc).__name__}: {exc}"
            return False
        # the id the router signs this server's routes for (a restarted server has a new one)
        worker.server_id = resp.headers.get(SERVER_ID_HEADER) or worker.server_id
        if resp.status_code == 200:
            worker.last_health_error = None
            return True
        worker.last_health_error = f"HTTP {resp.status_code}"
        if draining(worker, resp.headers):  # out of rotation now, not after N failed probes
            worker.last_health_error = "draining"
        return False

    async def _startup(self, worker: Worker) -> None:
        deadline = time.monotonic() + self._config.worker_startup_timeout_secs
        delay = 0.1
        while worker in self._registry:
            if await self.probe(worker):
                if await self._learn_dp(worker):
                    return
                worker.healthy, worker.starting = True, False
                worker.health_failures = worker.health_successes = 0
                log.info("%s worker %s is healthy", worker.worker_type, worker.url)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                worker.starting = False
                log.error(
                    "%s worker %s not healthy after %.0f s (%s); it stays unselectable until its "
                    "health checks pass",
                    worker.worker_type, worker.url, self._config.worker_startup_timeout_secs,
                    worker.last_health_error,
                )
                return
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 1.5, 5.0)

    async def _learn_dp(self, worker: Worker) -> bool:
        """--dp-aware / --prefill-round-robin-balance: read the server's dp_size; with
        --dp-aware and dp_size > 1 its entry becomes one per DP rank (True: done here)."""
        cfg = self._config
        if not (cfg.dp_aware or cfg.prefill_round_robin_balance):
            return False
        worker.dp_size = await self._dp_size(worker)
        if not cfg.dp_aware or worker.dp_size <= 1:
            return False
        ranks = self._registry.expand(worker, worker.dp_size)
        log.info("%s worker %s is healthy: %d DP ranks %s", worker.worker_type, worker.url,
                 len(ranks), ", ".join(w.key for w in ranks))
        return True

    async def _dp_size(self, worker: Worker) -> int:
        for path in ("/get_server_info", "/server_info"):
            try:
                resp = await self._client.get(worker.url + path,
                                              timeout=self._config.health_check_timeout_secs)
                info = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                info = None
            if isinstance(info, dict) and isinstance(info.get("dp_size"), int):
                return max(1, info["dp_size"])
        log.warning("%s worker %s did not say its dp_size; treating it as 1",
                    worker.worker_type, worker.url)
        return 1

    async def check_all(self) -> None:
        """One round of periodic checks over every worker past its startup wait."""
        await self._check([w for w in self._registry if not w.starting])

    def suspects(self) -> list[Worker]:
        return [w for w in self._registry if not w.starting and (
            not w.healthy or w.health_failures > 0
            or w.circuit.last_failure_at > w.last_probe_at)]

    def recovery_period(self) -> float:
        """Probe period of suspect workers: success_threshold probes fit in one interval."""
        cfg = self._config
        return min(RECOVERY_PROBE_S,
                   cfg.health_check_interval_secs / (cfg.health_success_threshold + 1))

    async def _check(self, workers: list[Worker]) -> None:
        results = await asyncio.gather(*(self.probe(w) for w in workers))
        cfg = self._config
        for worker, ok in zip(workers, results):
            if ok:
                worker.health_failures = 0
                worker.health_successes += 1
                worker.circuit.probe_ok(worker.last_probe_at)
                if not worker.healthy and worker.health_successes >= cfg.health_success_threshold:
                    worker.healthy = True
                    worker.circuit.retry_now()
                    log.info("%s worker %s is healthy again", worker.worker_type, worker.url)
            else:
                worker.health_successes = 0
                worker.health_failures += 1
                if worker.healthy and worker.health_failures >= cfg.health_failure_threshold:
                    worker.healthy = False
                    log.warning(
                        "%s worker %s marked unhealthy after %d failed checks (%s)",
                        worker.worker_type, worker.url, worker.health_failures,
                        worker.last_health_error,
                    )

    async def _periodic_health(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_check_interval_secs)
            try:
                await self.check_all()
            except Exception:  # a bug here must not silently stop health checking
                log.exception("health check round failed")

    async def _periodic_suspects(self) -> None:
        while True:
            await asyncio.sleep(self.recovery_period())
            try:
                suspects = self.suspects()
                if suspects:
                    await self._check(suspects)
            except Exception:  # a bug here must not silently stop recovery checks
                log.exception("suspect health check round failed")

    async def poll_loads(self) -> None:
        workers = list(self._registry)
        urls = list(dict.fromkeys(w.url for w in workers))  # a server's DP ranks share one
        bodies = await asyncio.gather(*(self._fetch_loads(u) for u in urls),
                                      return_exceptions=True)
        answers = dict(zip(urls, bodies))
        for worker in workers:
            body = answers[worker.url]
            worker.load = (-1 if body is None or isinstance(body, BaseException)
                           else parse_load(body, worker.dp_rank))

    async def _fetch_loads(self, url: str) -> Any:
        """The server's /get_load body, or None when it did not answer 200 with JSON."""
        try:
            resp = await self._client.get(
                url + "/get_load", timeout=self._config.health_check_timeout_secs
            )
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def _periodic_loads(self) -> None:
        while True:
            try:
                await self.poll_loads()
            except Exception:
                log.exception("load poll round failed")
            await asyncio.sleep(self._config.load_check_interval_secs)
