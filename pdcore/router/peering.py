"""Tells decode workers which prefill bootstrap addresses this router routes to, when the router
has no cluster secret to sign its routes with (pdcore.route_auth).

A decode server acts only on a route that is signed or names a trusted prefill address. Without
`--disaggregation-auth-token` the router cannot sign, so it registers its prefill workers'
bootstrap addresses with every decode worker (`POST /disaggregation/trusted_prefill`, an admin
route: the call carries the router's --admin-api-key, which the decode servers must share), and
drops those of prefill workers it removed.

1. `start()`: a task that, every `period()` seconds, reads each healthy decode worker's trusted
   set and posts what is missing or stale (a restarted decode server starts empty: it is
   caught on the next pass; `sync()` also runs at once when the proxy sees a route refused,
   and `ensure()` before a route goes to a decode worker not yet told every address);
2. `sync(worker)`: one exchange with one decode worker; False (and one rate-limited warning
   naming the fix) when the worker refuses it;
3. `stop()`: cancels the task.
Nothing here runs when the router signs routes (then no server needs to be told anything).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pdcore.config import DEFAULT_BOOTSTRAP_PORT
from pdcore.route_auth import normalize_addr
from pdcore.router.config import RouterConfig
from pdcore.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pdcore.router.peering")
PATH = "/disaggregation/trusted_prefill"
WARN_EVERY_S = 60.0


class TrustSync:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry,
                 client: httpx.AsyncClient) -> None:
        self._config, self._registry, self._client = config, registry, client
        self._task: asyncio.Task[None] | None = None
        self._told: dict[str, set[str]] = {}  # decode URL -> what we registered there
        self._warned: dict[str, float] = {}
        self.syncs = 0

    def wanted(self) -> set[str]:
        """Bootstrap addresses of the prefill workers (a port left to the servers' default is
        assumed to be the default, 8998)."""
        return {normalize_addr(w.bootstrap_host, w.bootstrap_port or DEFAULT_BOOTSTRAP_PORT)
                for w in self._registry.of_type("prefill")}

    def period(self) -> float:
        return max(0.5, min(5.0, self._config.health_check_interval_secs))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-peering")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            decodes = {w.url: w for w in self._registry.of_type("decode") if w.healthy}
            await asyncio.gather(*(self.sync(w) for w in decodes.values()))
            await asyncio.sleep(self.period())

    async def ensure(self, worker: Worker) -> None:
        """Before a route goes to `worker`: one sync now unless it has all our prefill addresses
        (a decode worker that just became healthy would otherwise refuse the first requests
        until the next periodic pass)."""
        if self._told.get(worker.url) != self.wanted():
            await self.sync(worker)

    async def sync(self, worker: Worker) -> bool:
        want = self.wanted()
        url, timeout = worker.url + PATH, self._config.health_check_timeout_secs
        try:
            resp = await self._client.get(url, timeout=timeout)
            have = set(resp.json().get("trusted", [])) if resp.status_code == 200 else None
            if resp.status_code == 404:  # not a pdserve decode server (or an old one)
                return False
            stale = self._told.get(worker.url, set()) - want
            if have is not None and want <= have and not (stale & have):
                self._told[worker.url] = want
                return True
            resp = await self._client.post(url, timeout=timeout, json={
                "add": sorted(want), "remove": sorted(stale)},
                headers=self._config.admin_headers())
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.debug("trust sync with %s failed: %s", worker.url, exc)
            return False
        if resp.status_code != 200:
            self._warn(worker.url, f"HTTP {resp.status_code}: {resp.text[:200]}")
            return False
        self._told[worker.url] = want
        self.syncs += 1
        log.info("told decode %s to accept routes to prefill %s", worker.url,
                 ", ".join(sorted(want)) or "(none)")
        return True

    def _warn(self, url: str, why: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(url, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        self._warned[url] = now
        log.warning("decode %s refused the router's prefill addresses (%s): it will refuse this "
                    "router's routes with 403. Give router and servers the same "
                    "--disaggregation-auth-token (the router then signs its routes), or the "
                    "same --admin-api-key", url, why)
