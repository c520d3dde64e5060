"""Several routers over the same workers (`--peer-routers URL ...`): what they must share.

A router keeps no per-request state that another router needs: bootstrap rooms are drawn at
random (63 bits), every router signs its routes with the same cluster secret and every server
checks any such signature (pdcore.route_auth), circuits and health are each router's own view of
the same servers. What they must share is the worker list. It comes from one of:
- Kubernetes service discovery: every router watches the same pods (the manifests run two);
- the command line (`pdserve up --routers N` gives each router the same workers) plus the admin
  calls made at run time, which this module relays:

1. `relay(method, payload)`: after an admin call changed this router's workers (POST/DELETE
   /workers, /add_worker, /remove_worker), the same change goes to every peer with the admin key
   and the header `x-pdserve-peer` (a peer does not relay a relayed call again). A peer that
   already agrees (409 on add, 404 on remove) counts as told; one that is down is logged and
   listed in the answer's `peers` (it catches up when it restarts, step 2);
2. `join()`, at start-up, before the router listens: `adopt()` asks the peers for their
   workers (`GET /workers`, the first that answers) and takes that list over, adding the
   workers it lacks and removing those the peer no longer has (a router restarted from its
   original command line thereby gets back the workers added or removed while it was down; no
   peer answering: it keeps its own list, as the first router of a fleet to start); then it
   waits until a prefill and a decode worker are available, up to JOIN_WAIT_S. Until then its
   port refuses connections, so a client (or balancer) that knows another router goes there,
   instead of getting 503 "no worker" from a router still probing its workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import JSONResponse

from pdcore.errors import ConfigError
from pdcore.router.fleet_sync import STAMP_HEADER, FleetSync

if TYPE_CHECKING:
    from pdcore.router.config import RouterConfig
    from pdcore.router.health import HealthMonitor
    from pdcore.router.workers import WorkerRegistry

log = logging.getLogger("pdcore.router.fleet")
PEER_HEADER = "x-pdserve-peer"
PEER_TIMEOUT_S = 5.0
ADOPT_TRIES, ADOPT_PAUSE_S = 3, 1.0
JOIN_WAIT_S = 30.0


class RouterFleet:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, client: httpx.AsyncClient,
                 monitor: HealthMonitor | None) -> None:
        self._config, self._registry = config, registry
        self._http, self._monitor = client, monitor
        self.peers = list(config.peer_routers)
        self.relayed = 0  # changes every peer took
        self.relay_failures = 0  # (peer, change) pairs that did not reach the peer
        self.adopted_from: str | None = None  # the peer whose worker list was taken at start
        # the ledger of admin changes, pulled from the peers now and then (fleet_sync.py)
        self.sync = FleetSync(config, registry, client, monitor, self._headers())

    def _headers(self) -> dict[str, str]:
        cfg = self._config
        # the admin key (the changes want it, and it passes the API-key check of GET
        # /workers too); without one, the API key (GET works, a relayed change gets 403)
        return {**cfg.worker_headers(), **cfg.admin_headers(), PEER_HEADER: "1"}

    async def relay(self, method: str, payload: dict[str, Any], stamp: float
                    ) -> dict[str, str]:
        """One change (made at `stamp`) to every peer; {peer: "ok" | why not}."""
        headers = {**self._headers(), STAMP_HEADER: repr(stamp)}

        async def one(peer: str) -> str:
            try:
                resp = await self._http.request(method, peer + "/workers", json=payload,
                                                    headers=headers,
                                                    timeout=PEER_TIMEOUT_S)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            agrees = (method == "POST" and resp.status_code == 409) or (
                method == "DELETE" and resp.status_code == 404)
            if resp.status_code < 300 or agrees:
                return "ok"
            return f"HTTP {resp.status_code}: {resp.text[:200]}"

        results = dict(zip(self.peers, await asyncio.gather(*(one(p) for p in self.peers)),
                           strict=True))
        for peer, outcome in results.items():
            if outcome == "ok":
                self.relayed += 1
            else:
                self.relay_failures += 1
                log.warning("router peer %s did not take %s /workers %s (%s); it takes the "
                            "change from this router's ledger on its next sync, or its list "
                            "when it restarts", peer, method, payload, outcome)
        return results

    async def join(self, wait_s: float = JOIN_WAIT_S) -> None:
        """Module doc, step 2: before the router listens."""
        await self.adopt()
        deadline = asyncio.get_running_loop().time() + wait_s
        while not self._registry.ready():
            if asyncio.get_running_loop().time() > deadline:
                log.warning("no prefill and decode worker available after %.0f s: listening "
                            "anyway (503 until one is)", wait_s)
                return
            await asyncio.sleep(0.1)
        log.info("workers available: this router listens now")

    async def adopt(self) -> str | None:
        """Take over the first answering peer's worker list (module doc, step 2); the peer's
        URL, or None when none answered."""
        for attempt in range(ADOPT_TRIES):
            for peer in self.peers:
                listed = await self._list(peer)
                if listed is not None:
                    self._take(peer, listed)
                    self.adopted_from = peer
                    return peer
            if attempt + 1 < ADOPT_TRIES:
                await asyncio.sleep(ADOPT_PAUSE_S)
        log.info("no router peer answered GET /workers; keeping this router's own worker list")
        return None

    async def _list(self, peer: str) -> dict[str, tuple[str, int | None]] | None:
        try:
            resp = await self._http.get(peer + "/workers", headers=self._headers(),
                                            timeout=PEER_TIMEOUT_S)
            if resp.status_code != 200:
                return None
            out: dict[str, tuple[str, int | None]] = {}
            for w in resp.json()["workers"]:
                url = str(w["url"]).split("@")[0] if w.get("dp_size", 1) > 1 else str(w["url"])
                out[url] = (str(w["worker_type"]), w.get("bootstrap_port"))
            return out
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.debug("router peer %s: no worker list (%s)", peer, exc)
            return None

    def _take(self, peer: str, listed: dict[str, tuple[str, int | None]]) -> None:
        registry, mini_lb = self._registry, self._config.mini_lb
        mine = {w.url: (w.worker_type, w.bootstrap_port) for w in registry}
        added, removed = [], []
        for url, role_port in mine.items():  # gone, or another role or bootstrap port there
            if listed.get(url) != role_port:
                registry.remove(url)
                removed.append(url)
        for url, (role, bootstrap_port) in listed.items():
            if registry.get(url) is not None:
                continue
            try:
                worker = registry.add(url, role, bootstrap_port, healthy=mini_lb)
            except ConfigError as exc:
                log.warning("router peer %s lists worker %s, which this router refuses: %s",
                            peer, url, exc)
                continue
            if self._monitor is not None and not mini_lb:
                self._monitor.watch_startup(worker)
            added.append(url)
        log.info("took the worker list of router peer %s: %d workers (added %s, removed %s)",
                 peer, len(listed), ", ".join(added) or "none", ", ".join(removed) or "none")

    def snapshot(self) -> dict[str, object]:
        return {"peers": self.peers, "adopted_from": self.adopted_from,
                "relayed": self.relayed, "relay_failures": self.relay_failures,
                **self.sync.snapshot()}


async def relayed(fleet: RouterFleet | None, request: Any, resp: Any, method: str,
                  payload: dict[str, Any]) -> Any:
    """`resp` (an admin call's JSONResponse) after relaying its change to the peers, whose
    outcomes it then lists under `peers`; unchanged when nothing changed, there are no peers
    or the call came from a peer."""
    if fleet is None or resp.status_code >= 300:
        return resp
    # the change goes into the ledger (a relayed one with its origin's stamp)
    stamp = fleet.sync.stamp(request.headers.get(STAMP_HEADER) if request.headers.get(
        PEER_HEADER) else None)
    body = json.loads(resp.body)
    w = body.get("worker") or {}  # what this router registered (or removed)
    url = str(w.get("url") or payload.get("url")).split("@")[0]  # a DP rank: its server
    fleet.sync.record(url, method == "POST", w.get("worker_type"), w.get("bootstrap_port"),
                      stamp)
    if request.headers.get(PEER_HEADER):
        return resp
    body["peers"] = await fleet.relay(method, payload, stamp)
    return JSONResponse(body, status_code=resp.status_code)
