"""Who may call what, on the servers and on the router (one mechanism for both).

Two credentials, each a bearer token (`Authorization: Bearer <key>`):

1. `--api-key K` (`install_auth(app, K, A, open_paths)`): every route but `open_paths`
   (/health; the router's /dashboard page) answers 401 without K or the admin key A. The
   router sends K on its own data-path calls to the workers.
2. `--admin-api-key A`: the admin routes, those that change state for everyone (the router's
   worker registration and removal, cache flushes, profiling, registrations of trusted prefill
   addresses), take `Depends(require_admin)` and answer only A:
   - no admin key configured: every admin route is off (403 saying how to turn it on);
   - the API key K: 403 (an API user is not an admin; an API key equal to the admin key is
     refused at start, config.check_keys);
   - no or another token: 401.
   Nothing else counts: not the peer's address (loopback included: every client behind nginx,
   a sidecar, `kubectl port-forward` or an SSH tunnel arrives from loopback), not
   X-Forwarded-For. The admin key also opens the ordinary routes (an admin may do what an API
   user may).
3. `log_admin_policy(app, log)` says at start which routes are admin routes and whether they
   are on, and how to turn them on.

Layering: the router imports this module (docs/architecture.md), so it imports nothing of the
server's engine side; only FastAPI and the standard library.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

HOW_TO_ADMIN = ("start this process with --admin-api-key A (or $PDSERVE_ADMIN_API_KEY, or "
                "$PDSERVE_ADMIN_API_KEY_FILE naming a file that holds it) and send "
                "'Authorization: Bearer A'")


def bearer_ok(header: str | None, key: str | None) -> bool:
    if not key:
        return False
    scheme, _, token = (header or "").partition(" ")
    # constant-time: the comparison must not tell how much of a guess was right
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def _error(status: int, kind: str, message: str) -> JSONResponse:
    # the OpenAI error shape the servers use on every route
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


class AdminRefused(HTTPException):
    """An admin route refused its caller (401 no or a wrong key, 403 not an admin key or admin
    routes off)."""


async def _refused(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, AdminRefused)
    kind = "unauthorized" if exc.status_code == 401 else "forbidden"
    response = _error(exc.status_code, kind, str(exc.detail))
    if exc.status_code == 401:
        response.headers["www-authenticate"] = "Bearer"
    return response


def install_auth(app: FastAPI, key: str | None, admin_key: str | None,
                 open_paths: Iterable[str]) -> None:
    """The API key check (when `key` is set) and the 401/403 answers of `require_admin`."""
    app.state.api_key = key
    app.state.admin_api_key = admin_key
    app.add_exception_handler(AdminRefused, _refused)
    if not key:
        return
    open_set = frozenset(open_paths)

    @app.middleware("http")
    async def require_api_key(request: Request,
                              call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        header = request.headers.get("authorization")
        if (request.url.path in open_set or bearer_ok(header, key)
                or bearer_ok(header, admin_key)):
            return await call_next(request)
        response = _error(401, "unauthorized",
                          "missing or wrong API key: send 'Authorization: Bearer <--api-key>'")
        response.headers["www-authenticate"] = "Bearer"
        return response


def require_admin(request: Request) -> None:
    """FastAPI dependency of every admin route (see the module doc)."""
    state = request.app.state
    admin_key = getattr(state, "admin_api_key", None)
    where = f"{request.method} {request.url.path}"
    if not admin_key:
        raise AdminRefused(403, f"{where} is an admin route and admin routes are off on this "
                                f"process (no admin key); {HOW_TO_ADMIN}")
    header = request.headers.get("authorization")
    if bearer_ok(header, admin_key):
        return
    if bearer_ok(header, getattr(state, "api_key", None)):
        raise AdminRefused(403, f"{where} is an admin route: the API key does not open it; "
                                "send 'Authorization: Bearer <--admin-api-key>'")
    raise AdminRefused(401, f"{where} is an admin route: missing or wrong admin key; send "
                            "'Authorization: Bearer <--admin-api-key>'")


def admin_routes(app: FastAPI) -> list[str]:
    """'METHOD path' of every route guarded by `require_admin`."""
    out: list[str] = []

    def walk(routes: Iterable[object], prefix: str) -> None:
        for route in routes:
            if isinstance(route, APIRoute):
                if any(d.call is require_admin for d in route.dependant.dependencies):
                    out.extend(f"{m} {prefix}{route.path}" for m in sorted(route.methods or ()))
                continue
            # FastAPI >= 0.16x keeps an included APIRouter as one entry wrapping the original
            inner = getattr(route, "original_router", None)
            if inner is not None:
                context = getattr(route, "include_context", None)
                walk(inner.routes, prefix + str(getattr(context, "prefix", "") or ""))

    walk(app.routes, "")
    return out


def log_admin_policy(app: FastAPI, log: logging.Logger) -> None:
    routes = ", ".join(admin_routes(app))
    if getattr(app.state, "admin_api_key", None):
        log.info("admin routes %s need 'Authorization: Bearer <--admin-api-key>' (the API key "
                 "does not open them)", routes)
    else:
        log.warning("admin routes %s are off (403): no admin key; to turn them on, %s",
                    routes, HOW_TO_ADMIN)
