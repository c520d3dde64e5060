"""Error bodies and exception handlers: every error is JSON
`{"error": {"message", "type", "param", "code"}}` (the OpenAI shape, used on every route);
`code` is the HTTP status (as SGLang answers), or for a refusal a caller acts on its named
reason (`pdcore.messages.codes.ErrorCode`, e.g. "route_refused").
FastAPI's 422 validation errors become 400 naming the offending field. An EngineError the client
caused (`client_caused`) carries its origin header (`engine_error_response`), and so does any
unexpected error (500) raised before the request reached the engine
(`generation.mark_engine_reached`): whatever fails while the server reads a client's request is
that request's doing, and the router neither retries it nor counts it against the server."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdcore.edge.schemas import validation_message
from pdcore.errors import ERROR_ORIGIN_HEADER, ForbiddenRouteError, InvalidRequestError
from pdcore.messages.codes import ErrorCode
from pdcore.runtime import EngineError
from pdcore.server.generation import engine_reached

log = logging.getLogger(__name__)

_FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def error_body(message: str, status: int, param: str | None = None,
               code: ErrorCode | None = None) -> dict[str, Any]:
    """`code`: the machine-readable reason (pdcore/messages/codes.py) a caller acts on; without
    one the HTTP status, as SGLang's servers answer."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else str(code)}}


def error_response(message: str, status: int, param: str | None = None,
                   code: ErrorCode | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def engine_error_response(e: EngineError) -> JSONResponse:
    response = error_response(str(e), e.status, code=ErrorCode(e.code) if e.code else None)
    response.headers.update(e.headers)  # the client-origin mark the router reads
    return response


def sse_error(message: str, status: int, code: str | None = None) -> bytes:
    body = error_body(message, status, code=ErrorCode(code) if code else None)
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    return validation_message(list(exc.errors()))


_last_refusal_log = [-1e9]


def _warn_refused(peer: str, why: str) -> None:
    """At most one line per 10 s (pdserve_routes_refused counts them all): a client flooding
    forged routes must not flood the log."""
    now = time.monotonic()
    if now - _last_refusal_log[0] >= 10.0:
        _last_refusal_log[0] = now
        log.warning("refused a PD route from %s (pdserve_routes_refused counts all): %s", peer,
                    why)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI raises these for a body it cannot decode (invalid UTF-8, nesting too deep for
        # the JSON parser), and Starlette for 404 / 405: same error shape as everything else
        param, message = None, str(exc.detail)
        if exc.status_code == 400 and message == _FASTAPI_PARSE_ERROR:
            param, message = "body", ("request body could not be parsed: send UTF-8 JSON "
                                      f"(FastAPI: {message})")
        return JSONResponse(error_body(message, exc.status_code, param),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        if isinstance(exc, ForbiddenRouteError):
            metrics = getattr(request.app.state, "metrics", None)
            if metrics is not None:
                metrics.routes_refused.inc()
            _warn_refused(request.client.host if request.client else "?", str(exc))
            code = ErrorCode(exc.code) if exc.code else ErrorCode.ROUTE_REFUSED
            return error_response(str(exc), 403, exc.field, code)
        return error_response(str(exc), 400, exc.field)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        return engine_error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
        if engine_reached(request):
            log.exception("unhandled error on %s", request.url.path)
        else:  # the client's content made the server fail before the engine saw it
            log.exception("unhandled error on %s before the engine (answered as the client's "
                          "doing: %s)", request.url.path, ERROR_ORIGIN_HEADER)
            response.headers[ERROR_ORIGIN_HEADER] = "client"
        return response
