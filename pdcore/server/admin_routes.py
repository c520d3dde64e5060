"""Operational routes: health, server/model info, load, cache flush, metrics, profiling.

The routes that change state (cache flush, profiling) are admin routes: `require_admin`
(pdcore.edge.auth) lets through only the --admin-api-key holder (off without one)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pdcore.edge.auth import require_admin
from pdcore.messages.codes import DRAINING_HEADER
from pdcore.messages.io import ControlKind
from pdcore.route_auth import WARMUP_HOST as FAKE_BOOTSTRAP_HOST
from pdcore.runtime import EngineError, EngineHandle, new_rid
from pdcore.server.generation import Item, collect, mark_engine_reached
from pdcore.server.http_errors import error_response
from pdcore.server.openai_plan import served_model_name
from pdcore.server.params import PDInfo
from pdcore.server.planner import plan_probe

log = logging.getLogger(__name__)
router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 30.0
_SECRET_FIELDS = {"disaggregation_auth_token", "api_key", "admin_api_key", "pd_route_secret"}


def _engine(request: Request) -> EngineHandle:
    return request.app.state.engine


@router.get("/health")
async def health(request: Request) -> Response:
    engine = _engine(request)
    drain = getattr(request.app.state, "drain", None)
    if drain is not None and drain.draining:
        return JSONResponse({"status": "draining", "in_flight": drain.in_flight,
                             "error": "server is draining (shutting down)"},
                            status_code=503, headers={DRAINING_HEADER: "1"})
    if engine.ready and getattr(request.app.state, "warming_up", False):
        return JSONResponse({"status": "warming_up", "error": None}, status_code=503)
    if engine.ready:
        return Response(status_code=200)
    return JSONResponse({"status": engine.state.value, "error": engine.error}, status_code=503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """One token through the whole engine; 200 when it comes back in time."""
    from pdcore.messages.io import PDRoute

    engine = _engine(request)
    if not engine.ready:
        return JSONResponse({"status": engine.state.value, "error": engine.error},
                            status_code=503)
    pd = PDInfo()
    if engine.args.disaggregation_mode != "null":
        pd = PDInfo(PDRoute(FAKE_BOOTSTRAP_HOST, engine.args.disaggregation_bootstrap_port, 0))
    token = int((engine.info.eos_token_ids or [0])[0])
    req = plan_probe(f"health-{new_rid()}", [token], engine, pd)
    mark_engine_reached(request)  # no client content here: an error is the server's
    try:
        await collect(engine, [Item(0, req)], request.app.state.metrics,
                      HEALTH_GENERATE_TIMEOUT_S)
    except EngineError as e:
        return error_response(f"health generation failed: {e}", 503)
    return Response(status_code=200)


def server_info(engine: EngineHandle) -> dict[str, Any]:
    args = {k: ("***" if k in _SECRET_FIELDS and v else v)
            for k, v in dataclasses.asdict(engine.args).items()}
    info = engine.info
    out: dict[str, Any] = {**args, **info.as_dict()}
    # routers read these; they must be local paths so nobody tries a model hub
    out["model_path"] = info.model_path or args.get("model_path")
    out["tokenizer_path"] = info.tokenizer_path or out["model_path"]
    out["served_model_name"] = served_model_name(engine)
    out["disaggregation_mode"] = engine.args.disaggregation_mode
    out["tp_size"] = engine.args.tp_size
    out["dp_size"] = engine.args.dp_size
    out["status"] = engine.state.value
    from importlib.metadata import PackageNotFoundError, version

    try:
        out["version"] = version("pdcore")
    except PackageNotFoundError:  # running from a source tree without installing
        out["version"] = "unknown"
    return out


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    return server_info(_engine(request))


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    info = server_info(engine)
    return {"model_path": info["model_path"], "tokenizer_path": info["tokenizer_path"],
            "is_generation": True, "served_model_name": info["served_model_name"],
            "model_type": engine.info.model_type,
            "architectures": engine.info.architectures,
            "context_length": engine.info.context_length}


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    data = await _engine(request).control(ControlKind.GET_LOAD)
    loads = data.get("loads") if isinstance(data.get("loads"), list) else [data]
    out = []
    for i, d in enumerate(loads):
        d = dict(d)
        d.setdefault("dp_rank", i)
        for k in ("num_reqs", "num_waiting_reqs", "num_tokens"):
            d.setdefault(k, 0)
        out.append(d)
    return JSONResponse(out)


@router.post("/flush_cache", dependencies=[Depends(require_admin)])
@router.get("/flush_cache", dependencies=[Depends(require_admin)])
async def flush_cache(request: Request) -> Response:
    try:
        data = await _engine(request).control(ControlKind.FLUSH_CACHE)
    except EngineError as e:
        if e.status == 500 and _engine(request).ready:  # refused (requests still running)
            return error_response(f"cache not flushed: {e}", 400)
        raise
    return JSONResponse({"success": bool(data.get("flushed")), "message": "cache flushed",
                         **data})


@router.post("/drain", dependencies=[Depends(require_admin)])
async def drain(request: Request) -> Response:
    """Start draining (as the first SIGTERM does): 503 to new requests, exit once the ones in
    flight are done or after --drain-timeout."""
    d = request.app.state.drain
    started = d.begin(_engine(request), "POST /drain")
    return JSONResponse({"success": True, "draining": True, "already": not started,
                         "in_flight": d.in_flight, "timeout_s": d.timeout_s})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = request.app.state.metrics
    engine = _engine(request)
    drain = getattr(request.app.state, "drain", None)
    m.draining.set(1 if drain is not None and drain.draining else 0)
    if engine.ready:
        try:
            m.update_from_stats(await engine.stats(timeout=5.0))
        except EngineError as e:  # scrapes must not fail because the scheduler is busy
            log.warning("metrics: scheduler stats unavailable: %s", e)
    from pdcore.server.metrics import CONTENT_TYPE

    return Response(m.render(), media_type=CONTENT_TYPE)


async def _profile(request: Request, kind: ControlKind) -> Response:
    args: dict[str, Any] = {}
    body = await request.body()
    if body.strip():
        import json

        try:
            parsed = json.loads(body)
        except ValueError:
            return error_response("request body is not valid JSON", 400, "body")
        if not isinstance(parsed, dict):
            return error_response("request body must be a JSON object", 400, "body")
        args = {k: v for k, v in parsed.items() if v is not None}
    engine = _engine(request)
    args.setdefault("output_dir", engine.args.profile_output_dir)
    t0 = time.time()
    data = await engine.control(kind, args, timeout=60.0)
    return JSONResponse({"success": True, "seconds": round(time.time() - t0, 3), **data})


@router.post("/start_profile", dependencies=[Depends(require_admin)])
async def start_profile(request: Request) -> Response:
    return await _profile(request, ControlKind.START_PROFILE)


@router.post("/stop_profile", dependencies=[Depends(require_admin)])
async def stop_profile(request: Request) -> Response:
    return await _profile(request, ControlKind.STOP_PROFILE)
