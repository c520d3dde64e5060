"""Routers of a fleet (`--peer-routers`) converge on one worker list, even after missing a relay.

fleet.py relays each admin change to the peers once; a peer that was down, frozen or cut off
then misses it. Here every router keeps a ledger of the admin changes it knows and, every
--peer-sync-interval-secs, pulls each peer's ledger and merges it:

1. The ledger: worker URL -> (stamp, present, role, bootstrap port). The workers of the command
   line (or taken from a peer at start) have stamp 0; an admin add or remove gets a fresh stamp
   (wall-clock seconds, kept above every stamp seen: a Lamport clock that reads like a time);
   a change relayed by a peer keeps the peer's stamp (header `x-pdserve-stamp`). A remove
   leaves a tombstone, so it is not undone by a peer that still lists the worker.
2. The merge: per URL the entry with the larger stamp wins (ties: present first, then role and
   port, so every router picks the same); the winner is applied to this router's registry (the
   worker added, and probed like one added by hand, or removed). Last writer wins: two admins
   changing the same worker on two routers at once end with the later change everywhere.
3. Trust: `GET /fleet/ledger` is an admin route (the peer sends the admin key, as the relay
   does). With a cluster secret (--disaggregation-auth-token) its answer is signed (HMAC-SHA256
   over the body with a key derived from the secret, header `x-pdserve-ledger-sig`) and an
   unsigned or badly signed answer is refused: a router takes workers only from a router that
   holds the secret. Replaying an old ledger changes nothing (its stamps lose). What a peer
   sends is bounded: at most MAX_LEDGER_BYTES read, MAX_ENTRIES entries, each checked (URL,
   role, port, stamp finite and at most MAX_FUTURE_S ahead of this router's clock); a bad
   answer is dropped whole, counted and logged.
4. Bounded state: at most MAX_ENTRIES entries here; the oldest tombstones go first.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from pdcore.errors import ConfigError
from pdcore.router.config import normalize_url

if TYPE_CHECKING:
    from pdcore.router.config import RouterConfig
    from pdcore.router.health import HealthMonitor
    from pdcore.router.workers import WorkerRegistry

log = logging.getLogger("pdcore.router.fleet_sync")
PATH = "/fleet/ledger"
SIG_HEADER = "x-pdserve-ledger-sig"
STAMP_HEADER = "x-pdserve-stamp"
MAX_ENTRIES = 4096
MAX_LEDGER_BYTES = 1 << 20
MAX_FUTURE_S = 300.0  # a stamp further ahead than this is refused (it would win for ever)
MAX_URL = 2048
SYNC_TIMEOUT_S = 5.0


def ledger_key(route_key: bytes) -> bytes:
    return hmac.new(route_key, b"pdserve router ledger v1", hashlib.sha256).digest()


def sign(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Entry:
    stamp: float
    present: bool
    role: str
    port: int | None

    def rank(self) -> tuple[float, int, str, int]:
        return (self.stamp, int(self.present), self.role, self.port or 0)


class BadLedger(ValueError):
    pass


def parse_entries(raw: bytes, now: float) -> dict[str, Entry]:
    """A peer's ledger, checked whole (module doc, point 3); BadLedger on anything off."""
    if len(raw) > MAX_LEDGER_BYTES:
        raise BadLedger(f"over {MAX_LEDGER_BYTES} bytes")
    try:
        entries = json.loads(raw)["entries"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadLedger(f"not a ledger: {exc}") from None
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise BadLedger(f"entries must be a list of at most {MAX_ENTRIES}")
    out: dict[str, Entry] = {}
    for e in entries:
        if not isinstance(e, dict):
            raise BadLedger("an entry is not an object")
        url, stamp, present = e.get("url"), e.get("stamp"), e.get("present")
        role, port = e.get("role"), e.get("bootstrap_port")
        if not isinstance(url, str) or len(url) > MAX_URL:
            raise BadLedger("an entry's url is not a string of at most 2048 characters")
        try:
            url = normalize_url(url)
        except ConfigError as exc:
            raise BadLedger(str(exc)) from None
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or \
                not math.isfinite(stamp) or stamp < 0 or stamp > now + MAX_FUTURE_S:
            raise BadLedger(f"entry {url}: stamp {stamp!r} is not a time up to now + "
                            f"{MAX_FUTURE_S:g} s")
        if not isinstance(present, bool) or role not in ("prefill", "decode"):
            raise BadLedger(f"entry {url}: present must be a boolean, role prefill or decode")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or
                                 not 0 < port < 65536 or role != "prefill"):
            raise BadLedger(f"entry {url}: bootstrap_port {port!r} is not a prefill's port")
        out[url] = Entry(float(stamp), present, role, port)
    return out


class FleetSync:
    """The ledger, its route, and the periodic pull from the peers (module doc)."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry,
                 client: httpx.AsyncClient, monitor: HealthMonitor | None,
                 headers: dict[str, str]) -> None:
        self._config, self._registry, self._http = config, registry, client
        self._monitor, self._headers = monitor, headers
        self._key = ledger_key(config.route_key) if config.route_key else None
        self.entries: dict[str, Entry] = {}
        self._clock = 0.0
        self._task: asyncio.Task[None] | None = None
        self.syncs = self.sync_failures = self.changes_taken = 0
        self._warned: set[str] = set()

    # ---- the ledger ------------------------------------------------------------------------
    def seed(self) -> None:
        """The workers this router starts with (after taking a peer's list): stamp 0."""
        for w in self._registry:
            self.entries.setdefault(w.url, Entry(0.0, True, w.worker_type, w.bootstrap_port))

    def stamp(self, given: str | None = None) -> float:
        """A fresh stamp, or a peer's relayed one when it is sane."""
        now = time.time()
        try:
            s = float(given) if given is not None else math.nan
        except ValueError:
            s = math.nan
        if not (math.isfinite(s) and 0 < s <= now + MAX_FUTURE_S):
            s = max(now, self._clock + 1e-3)
        self._clock = max(self._clock, s)
        return s

    def record(self, url: str, present: bool, role: str | None, port: int | None,
               stamp: float) -> None:
        url = url.strip().rstrip("/")
        if role is None:  # a remove: the role it had
            old = self.entries.get(url)
            role = old.role if old else "decode"
        self._put(url, Entry(stamp, present, role, port if present else None))

    def _put(self, url: str, entry: Entry) -> None:
        self.entries[url] = entry
        if len(self.entries) > MAX_ENTRIES:  # the oldest tombstones first, then the oldest
            drop = sorted(self.entries, key=lambda u: (self.entries[u].present,
                                                       self.entries[u].stamp))
            for u in drop[:len(self.entries) - MAX_ENTRIES]:
                del self.entries[u]

    def body(self) -> tuple[bytes, dict[str, str]]:
        """GET /fleet/ledger's body and headers (signed with the cluster secret's key)."""
        body = json.dumps({"entries": [
            {"url": u, "stamp": e.stamp, "present": e.present, "role": e.role,
             "bootstrap_port": e.port} for u, e in self.entries.items()]}).encode()
        return body, ({SIG_HEADER: sign(self._key, body)} if self._key else {})

    # ---- the pull --------------------------------------------------------------------------
    def period(self) -> float:
        return self._config.peer_sync_interval_secs

    def start(self) -> None:
        if self.period() > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="router-fleet-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period())
            for peer in self._config.peer_routers:
                await self.pull(peer)

    async def pull(self, peer: str) -> bool:
        """One merge of `peer`'s ledger; False (counted, logged once per reason) when its
        answer was refused or it did not answer."""
        try:
            raw = await self._fetch(peer)
            entries = parse_entries(raw, time.time())
        except (httpx.HTTPError, BadLedger) as exc:
            self.sync_failures += 1
            why = f"{type(exc).__name__}: {exc}"
            key = f"{peer} {type(exc).__name__}"
            if isinstance(exc, BadLedger) and key not in self._warned:  # once per peer
                self._warned.add(key)
                log.warning("router peer %s: its worker ledger is refused (%s)", peer, why[:300])
            else:
                log.debug("router peer %s: no worker ledger (%s)", peer, why[:300])
            return False
        self.syncs += 1
        self.merge(entries, peer)
        return True

    async def _fetch(self, peer: str) -> bytes:
        async with self._http.stream("GET", peer + PATH, headers=self._headers,
                                     timeout=SYNC_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                raise BadLedger(f"HTTP {resp.status_code}")
            raw = b""
            async for chunk in resp.aiter_bytes():
                raw += chunk
                if len(raw) > MAX_LEDGER_BYTES:
                    raise BadLedger(f"over {MAX_LEDGER_BYTES} bytes")
            sig = resp.headers.get(SIG_HEADER, "")
        if self._key is not None and not hmac.compare_digest(sign(self._key, raw), sig):
            raise BadLedger("not signed with this router's cluster secret")
        return raw

    def merge(self, entries: dict[str, Entry], peer: str) -> None:
        for url, theirs in entries.items():
            mine = self.entries.get(url)
            self._clock = max(self._clock, theirs.stamp)
            if mine is not None and mine.rank() >= theirs.rank():
                continue
            self._put(url, theirs)
            if self._apply(url, theirs):
                self.changes_taken += 1
                log.info("router peer %s: worker %s %s (a change this router missed)", peer,
                         url, f"added as {theirs.role}" if theirs.present else "removed")

    def _apply(self, url: str, e: Entry) -> bool:
        """The registry made to agree with `e`; True when it changed."""
        have = self._registry.get(url)
        same = have is not None and have.worker_type == e.role and have.bootstrap_port == e.port
        if e.present == (have is not None) and (same or not e.present):
            return False
        if have is not None:
            self._registry.remove(url)
        if not e.present:
            return True
        mini_lb = self._config.mini_lb
        try:
            worker = self._registry.add(url, e.role, e.port, healthy=mini_lb)
        except ConfigError as exc:
            log.warning("router ledger lists worker %s, which this router refuses: %s", url, exc)
            return have is not None
        if self._monitor is not None and not mini_lb:
            self._monitor.watch_startup(worker)
        return True

    def snapshot(self) -> dict[str, object]:
        return {"syncs": self.syncs, "sync_failures": self.sync_failures,
                "changes_taken": self.changes_taken, "ledger_entries": len(self.entries),
                "signed": self._key is not None}
