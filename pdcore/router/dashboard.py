"""The live cluster page: `GET /dashboard` (one HTML page with a little JavaScript, no build
step) and `GET /dashboard/data`, the JSON it polls every REFRESH_S seconds.

For each data call the router asks every registered worker for `/get_load` at once, each with
FETCH_TIMEOUT_S, and joins the answer with what the router itself knows of the worker (health,
circuit, its own in-flight requests). A worker that does not answer in time is shown down at
once, before the health checker marks it unhealthy. "Recent" transfer speed is the mean
per-transfer speed over the transfers of the last RECENT_WINDOW_S (the KV manager's speed
histogram differenced against a snapshot kept here), falling back to the last transfer's.
With --api-key the page itself is public (it holds no data) and asks for the key, which it
sends on each data call.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

import pdcore
from pdcore.messages.stats import LastTransfer, RankLoad, TransferTotals
from pdcore.router.dashboard_page import PAGE
from pdcore.router.upstream import exc_reason
from pdcore.router.workers import Worker

if TYPE_CHECKING:
    from pdcore.router.state import RouterState

REFRESH_S = 2.0
FETCH_TIMEOUT_S = 1.5  # under REFRESH_S, so a hung worker never delays the next refresh
RECENT_WINDOW_S = 30.0


def summarize_load(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One worker's `/get_load` answer (one dict per DP rank, read as RankLoad) as the page's
    numbers."""
    loads = [RankLoad.from_json(r, rank) for rank, r in enumerate(ranks)]
    total = sum(r.num_pages_total for r in loads)
    used = sum(r.num_pages_used for r in loads)
    queues: dict[str, int] = {}
    for r in loads:
        for name, n in r.queues.items():
            queues[name] = queues.get(name, 0) + n
    prompt = sum(r.prompt_tokens_total for r in loads)
    cached = sum(r.cache_hit_tokens_total for r in loads)
    return {
        "running": sum(r.num_running_reqs for r in loads),
        "waiting": sum(r.num_waiting_reqs for r in loads),
        "tokens": sum(r.num_tokens for r in loads),
        "pages_used": used, "pages_total": total,
        "pool_usage": used / total if total else 0.0,
        "queues": dict(sorted(queues.items())),
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "dp_ranks": len(loads),
    }


def transfer_totals(ranks: list[dict[str, Any]]) -> TransferTotals | None:
    """Summed KV-transfer counters of a worker's ranks (typed: messages/stats.TransferTotals);
    None when it reports none (unified)."""
    return TransferTotals.of([r.get("kv_transfer") for r in ranks])


class SpeedWindow:
    """Per worker, (time, speed sum, transfer count) snapshots of the last RECENT_WINDOW_S."""

    def __init__(self, window_s: float = RECENT_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[str, deque[tuple[float, float, int]]] = {}

    def recent(self, url: str, speed_sum: float, count: int, now: float) -> float | None:
        """Mean GB/s of the transfers since the oldest snapshot in the window (None: none)."""
        seen = self._seen.setdefault(url, deque())
        while seen and now - seen[0][0] > self.window_s:
            seen.popleft()
        seen.append((now, speed_sum, count))
        _, old_sum, old_count = seen[0]
        if count < old_count:  # the worker restarted: its counters began again
            seen.clear()
            seen.append((now, speed_sum, count))
            return None
        return (speed_sum - old_sum) / (count - old_count) if count > old_count else None

    def forget_others(self, urls: set[str]) -> None:
        for url in [u for u in self._seen if u not in urls]:
            del self._seen[url]


def _status(worker: Worker, reachable: bool) -> str:
    if worker.starting and not worker.healthy:
        return "starting"
    if not reachable or not worker.healthy:
        return "down"
    return "up" if worker.circuit.allows_requests() else "circuit_open"


async def _fetch_load(client: httpx.AsyncClient, url: str) -> tuple[Any, str | None]:
    try:
        resp = await client.get(url + "/get_load", timeout=FETCH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return None, exc_reason(exc)
    if resp.status_code != 200:
        return None, f"/get_load answered {resp.status_code}"
    try:
        payload = resp.json()
    except ValueError:
        return None, "/get_load answered non-JSON"
    ranks = payload if isinstance(payload, list) else [payload]
    if not all(isinstance(r, dict) for r in ranks):
        return None, "/get_load answered an unknown shape"
    return ranks, None


def worker_view(worker: Worker, ranks: list[dict[str, Any]] | None, error: str | None,
                speeds: SpeedWindow, now: float) -> dict[str, Any]:
    reachable = ranks is not None
    view: dict[str, Any] = {
        "url": worker.url, "role": worker.worker_type, "status": _status(worker, reachable),
        "healthy": worker.healthy, "reachable": reachable,
        "circuit": worker.circuit.state.value, "router_in_flight": worker.in_flight,
        "health_error": worker.last_health_error, "error": error,
        "load": summarize_load(ranks) if ranks is not None else None, "transfer": None,
    }
    totals = transfer_totals(ranks) if ranks is not None else None
    if totals is not None:
        recent = speeds.recent(worker.url, totals.speed_sum, totals.speed_count, now)
        last = totals.last or LastTransfer()
        view["transfer"] = {
            "backend": totals.backend, "transfers": totals.transfers,
            "bytes": totals.bytes, "failures": totals.failures,
            "recent_speed_gb_s": recent, "last_speed_gb_s": last.speed_gb_s,
            "last_latency_ms": last.latency_ms,
        }
    return view


def build_dashboard_router(state: RouterState) -> APIRouter:
    router = APIRouter()
    speeds = SpeedWindow()
    started = time.time()

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE.replace("__REFRESH_MS__", str(int(REFRESH_S * 1000))))

    @router.get("/dashboard/data")
    async def dashboard_data() -> JSONResponse:
        assert state.client is not None  # created by the app lifespan before serving
        workers = list(state.registry)
        urls = list(dict.fromkeys(w.url for w in workers))  # a server's DP ranks share one
        answers = dict(zip(urls, await asyncio.gather(
            *(_fetch_load(state.client, u) for u in urls))))
        now = time.monotonic()
        views = [worker_view(w, *answers[w.url], speeds, now) for w in workers]
        speeds.forget_others({w.url for w in workers})
        cfg = state.config
        return JSONResponse({
            "router": {
                "version": pdcore.__version__, "uptime_s": round(time.time() - started, 1),
                "ready": state.registry.ready(), "mini_lb": cfg.mini_lb,
                "prefill_policy": cfg.effective_prefill_policy,
                "decode_policy": cfg.effective_decode_policy,
            },
            "refresh_s": REFRESH_S,
            "workers": views,
        })

    return router
