"""Admin and info routes: worker management at run time, and calls fanned out to workers.

Worker management: `POST /workers` `{"url", "worker_type": "prefill"|"decode", "bootstrap_port"}`
(200 when the worker's first /health passes at once, else 202 and it becomes selectable once
healthy), `DELETE /workers` (JSON `{"url"}` or `?url=`), `DELETE /workers/{url}`, `GET /workers`;
legacy `POST /add_worker?url=&worker_type=&bootstrap_port=` and `POST /remove_worker?url=`.
Info: `/get_server_info` (= `/server_info`), `/get_model_info` (= `/model_info`), `/v1/models`,
`/flush_cache`, `/get_loads`, `/health_generate`.

Every route that changes state (adding or removing workers, flushing the workers' caches) is an
admin route (`pdcore.edge.auth.require_admin`): it needs --admin-api-key's bearer token (the
API key does not open it; no admin key: off, 403), whatever address the call comes from. An
open `POST /workers` let anyone who could reach the router (or any API user) add a worker and
receive other users' prompts. The read-only routes stay behind --api-key alone. The flush
fan-out to the workers carries the router's admin key (the workers' admin routes want it).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

import pdcore
from pdcore.edge.auth import require_admin
from pdcore.errors import ConfigError
from pdcore.router.fleet import relayed
from pdcore.router.health import parse_load
from pdcore.router.workers import DuplicateWorkerError, Worker

if TYPE_CHECKING:
    from pdcore.router.state import RouterState


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


async def _get_json(
    client: httpx.AsyncClient, worker: Worker, paths: tuple[str, ...], timeout: float
) -> tuple[int, Any]:
    """GET the first of `paths` that is not 404; (status, JSON or error text)."""
    status, payload = 404, f"none of {', '.join(paths)} exists on {worker.url}"
    for path in paths:
        try:
            resp = await client.get(worker.url + path, timeout=timeout)
        except httpx.HTTPError as exc:
            return 502, f"{worker.url}{path}: {type(exc).__name__}: {exc}"
        if resp.status_code == 404:
            continue
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text[:500]
    return status, payload


def _parse_port(raw: Any) -> int | None:
    if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "null")):
        return None
    if isinstance(raw, bool):
        raise ConfigError("bootstrap_port must be an integer or null")
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"bootstrap_port must be an integer or null, got {raw!r}") from None


def build_admin_router(state: RouterState) -> APIRouter:
    router = APIRouter()
    admin = [Depends(require_admin)]
    cfg = state.config
    info_timeout = max(cfg.health_check_timeout_secs, 10.0)

    def client() -> httpx.AsyncClient:
        assert state.client is not None  # created by the app lifespan before serving
        return state.client

    async def add_worker(url: Any, worker_type: Any, bootstrap_port: Any) -> JSONResponse:
        if not isinstance(url, str) or not url:
            return _error(400, "invalid_request", "give the worker as {\"url\": \"http://host:port\"}")
        try:
            worker = state.registry.add(url, str(worker_type), _parse_port(bootstrap_port),
                                        healthy=cfg.mini_lb)
        except DuplicateWorkerError as exc:
            return _error(409, "worker_exists", str(exc))
        except ConfigError as exc:
            return _error(400, "invalid_request", str(exc))
        if cfg.mini_lb:
            return JSONResponse({"status": "added", "worker": worker.snapshot()})
        assert state.monitor is not None
        if await state.monitor.probe(worker):
            worker.healthy, worker.starting = True, False
            return JSONResponse({"status": "added", "worker": worker.snapshot()})
        state.monitor.watch_startup(worker)
        return JSONResponse({"status": "pending_health", "worker": worker.snapshot()}, 202)

    def remove_worker(url: Any) -> JSONResponse:
        if not isinstance(url, str) or not url:
            return _error(400, "invalid_request", "give the worker URL as ?url= or {\"url\": ...}")
        try:
            worker = state.registry.remove(url)
        except KeyError as exc:
            return _error(404, "worker_not_found", str(exc.args[0]))
        return JSONResponse({"status": "removed", "worker": worker.snapshot()})

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw.strip():
            return {}
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise TypeError("the body must be a JSON object")
        return body

    @router.post("/workers", dependencies=admin)
    async def post_workers(request: Request) -> JSONResponse:
        try:
            body = await json_body(request)
        except (ValueError, TypeError) as exc:
            return _error(400, "invalid_request", f"bad JSON body: {exc}")
        resp = await add_worker(body.get("url"), body.get("worker_type"),
                                body.get("bootstrap_port"))
        return await relayed(state.fleet, request, resp, "POST", {
            k: body.get(k) for k in ("url", "worker_type", "bootstrap_port")})

    @router.delete("/workers", dependencies=admin)
    async def delete_workers(request: Request) -> JSONResponse:
        try:
            body = await json_body(request)
        except (ValueError, TypeError) as exc:
            return _error(400, "invalid_request", f"bad JSON body: {exc}")
        url = request.query_params.get("url") or body.get("url")
        return await relayed(state.fleet, request, remove_worker(url), "DELETE", {"url": url})

    @router.delete("/workers/{url:path}", dependencies=admin)
    async def delete_worker_path(url: str, request: Request) -> JSONResponse:
        return await relayed(state.fleet, request, remove_worker(url), "DELETE", {"url": url})

    @router.get("/workers")
    async def list_workers() -> JSONResponse:
        workers = [w.snapshot() for w in state.registry]
        counts = {t: len(state.registry.of_type(t)) for t in ("prefill", "decode")}
        body: dict[str, Any] = {"workers": workers, "total": len(workers), "stats": counts}
        # the prefill-decode pairs that failed since they last closed (router/pairs.py)
        body["pairs"] = state.proxy.pairs.snapshot() if state.proxy is not None else []
        if state.fleet is not None:  # --peer-routers: who this router relays to, what it took
            body["fleet"] = state.fleet.snapshot()
        return JSONResponse(body)

    @router.get("/fleet/ledger", dependencies=admin)
    async def fleet_ledger() -> Response:
        """--peer-routers: the worker changes this router knows (router/fleet_sync.py)."""
        if state.fleet is None:
            return _error(404, "not_found", "this router has no --peer-routers")
        body, headers = state.fleet.sync.body()
        return Response(body, media_type="application/json", headers=headers)

    @router.post("/add_worker", dependencies=admin)
    async def legacy_add(request: Request) -> JSONResponse:
        q = request.query_params
        resp = await add_worker(q.get("url"), q.get("worker_type"), q.get("bootstrap_port"))
        return await relayed(state.fleet, request, resp, "POST", {
            k: q.get(k) for k in ("url", "worker_type", "bootstrap_port")})

    @router.post("/remove_worker", dependencies=admin)
    async def legacy_remove(request: Request) -> JSONResponse:
        url = request.query_params.get("url")
        return await relayed(state.fleet, request, remove_worker(url), "DELETE", {"url": url})

    async def server_infos() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for role in ("prefill", "decode"):
            workers = state.registry.of_type(role)
            results = await asyncio.gather(*(
                _get_json(client(), w, ("/get_server_info", "/server_info"), info_timeout)
                for w in workers
            ))
            out[role] = [
                payload if status == 200 and isinstance(payload, dict)
                else {"url": w.url, "error": payload, "status": status}
                for w, (status, payload) in zip(workers, results)
            ]
        return out

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def get_server_info() -> JSONResponse:
        info = await server_infos()
        info["router"] = {
            "version": pdcore.__version__,
            "pd_disaggregation": True,
            "mini_lb": cfg.mini_lb,
            "prefill_policy": cfg.effective_prefill_policy,
            "decode_policy": cfg.effective_decode_policy,
            "workers": state.registry.snapshot(),
        }
        return JSONResponse(info)

    def candidates(role: str) -> list[Worker]:
        available = state.registry.available(role)
        return available + [w for w in state.registry.of_type(role) if w not in available]

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def get_model_info() -> JSONResponse:
        last: tuple[int, Any] = (503, "no prefill worker is registered")
        for worker in candidates("prefill"):
            last = await _get_json(client(), worker, ("/get_model_info", "/model_info"), info_timeout)
            if last[0] == 200:
                return JSONResponse(last[1])
        return _error(last[0] if last[0] >= 400 else 502, "model_info_unavailable", str(last[1]))

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        workers = candidates("decode") + candidates("prefill")
        for worker in workers:
            status, payload = await _get_json(client(), worker, ("/v1/models",), info_timeout)
            if status == 200 and isinstance(payload, dict):
                return JSONResponse(payload)
        for worker in workers:  # fallback: a model card built from server info
            status, payload = await _get_json(
                client(), worker, ("/get_server_info", "/server_info"), info_timeout
            )
            if status == 200 and isinstance(payload, dict):
                name = payload.get("served_model_name") or payload.get("model_path") or "unknown"
                card = {"id": name, "object": "model", "owned_by": "pdserve", "root": name}
                return JSONResponse({"object": "list", "data": [card]})
        return _error(503, "models_unavailable", "no worker answered /v1/models or server info")

    @router.post("/flush_cache", dependencies=admin)
    async def flush_cache() -> JSONResponse:
        workers = list(state.registry)

        async def flush(w: Worker) -> dict[str, Any]:
            try:
                resp = await client().post(w.url + "/flush_cache", timeout=info_timeout,
                                           headers=cfg.admin_headers())
                return {"url": w.url, "status": resp.status_code, "ok": resp.status_code < 300}
            except httpx.HTTPError as exc:
                return {"url": w.url, "ok": False, "error": f"{type(exc).__name__}: {exc}"}

        results = list(await asyncio.gather(*(flush(w) for w in workers)))
        ok = all(r["ok"] for r in results)
        return JSONResponse({"success": ok, "results": results}, status_code=200 if ok else 500)

    @router.get("/get_loads")
    async def get_loads() -> JSONResponse:
        workers = list(state.registry)
        results = await asyncio.gather(
            *(_get_json(client(), w, ("/get_load",), info_timeout) for w in workers)
        )
        return JSONResponse({"workers": [
            {"url": w.url, "worker_type": w.worker_type, "status": status,
             "num_tokens": parse_load(payload) if status == 200 else -1, "load": payload}
            for w, (status, payload) in zip(workers, results)
        ]})

    @router.get("/health_generate")
    async def health_generate() -> JSONResponse:
        prefill, decode = state.registry.available("prefill"), state.registry.available("decode")
        if not prefill or not decode:
            return _error(503, "server_selection_failed", "no available prefill/decode pair")
        pair = (random.choice(prefill), random.choice(decode))
        timeout = max(cfg.health_check_timeout_secs, 30.0)

        async def check(w: Worker) -> dict[str, Any]:
            try:
                resp = await client().get(w.url + "/health_generate", timeout=timeout)
                return {"url": w.url, "status": resp.status_code}
            except httpx.HTTPError as exc:
                return {"url": w.url, "status": None, "error": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(check(w) for w in pair))
        ok = all(r["status"] == 200 for r in results)
        body = {"healthy": ok, "prefill": results[0], "decode": results[1]}
        return JSONResponse(body, status_code=200 if ok else 503)

    return router
