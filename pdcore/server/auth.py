"""Who may call what, on the servers and on the router (one mechanism for both).

1. `--api-key K` (`install_auth(app, key, open_paths)`): every route but `open_paths` (/health;
   the router's /dashboard page) answers 401 without `Authorization: Bearer K`. The router
   sends the same key on its own calls to the workers.
2. Admin routes, those that change state (the router's worker registration and removal, cache
   flushes, profiling, registrations of trusted peers), take `Depends(require_admin)`: with a
   key they need it like every route; without one they answer only clients whose TCP peer
   address is loopback (127.0.0.0/8, ::1) and refuse everyone else with 403 saying to set
   --api-key. The peer address is the socket's (`request.client`): X-Forwarded-For and the
   like are client-controlled and never read. A rogue worker added through an open
   `POST /workers` received every user prompt; this makes that need the key or a shell on
   the router's host.
3. `log_admin_policy(app, log)` says at start which routes are admin-only and how.

Layering: the router imports this module (docs/architecture.md), so it imports nothing of the
server's engine side; only FastAPI and the standard library.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

HOW_TO_ADMIN = ("set --api-key K on this process and send 'Authorization: Bearer K', or call "
                "it from this host (loopback)")


def bearer_ok(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # constant-time: the comparison must not tell how much of a guess was right
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def is_loopback_peer(host: str | None) -> bool:
    """True when `host` (a socket's peer address) is this machine's loopback. Names are not
    addresses: 'localhost' or 'testclient' never pass, nor does an unknown peer (None)."""
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
    return addr.is_loopback


def _error(status: int, kind: str, message: str) -> JSONResponse:
    # the OpenAI error shape the servers use on every route
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


class AdminRefused(HTTPException):
    """An admin route refused its caller (401 wrong key, 403 not allowed without a key)."""


async def _refused(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, AdminRefused)
    kind = "unauthorized" if exc.status_code == 401 else "forbidden"
    response = _error(exc.status_code, kind, str(exc.detail))
    if exc.status_code == 401:
        response.headers["www-authenticate"] = "Bearer"
    return response


def install_auth(app: FastAPI, key: str | None, open_paths: Iterable[str]) -> None:
    """The API key check (when `key` is set) and the 401/403 answers of `require_admin`."""
    app.state.api_key = key
    app.add_exception_handler(AdminRefused, _refused)
    if not key:
        return
    open_set = frozenset(open_paths)

    @app.middleware("http")
    async def require_api_key(request: Request,
                              call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path in open_set or bearer_ok(request.headers.get("authorization"), key):
            return await call_next(request)
        response = _error(401, "unauthorized",
                          "missing or wrong API key: send 'Authorization: Bearer <--api-key>'")
        response.headers["www-authenticate"] = "Bearer"
        return response


def require_admin(request: Request) -> None:
    """FastAPI dependency of every route that changes state (see the module doc)."""
    key = getattr(request.app.state, "api_key", None)
    if key:
        if not bearer_ok(request.headers.get("authorization"), key):
            raise AdminRefused(401, "missing or wrong API key: send 'Authorization: Bearer "
                                    "<--api-key>'")
        return
    peer = request.client.host if request.client else None
    if not is_loopback_peer(peer):
        raise AdminRefused(403, f"{request.method} {request.url.path} is an admin route: "
                                f"without --api-key it answers only loopback clients, and "
                                f"this call came from {peer or 'an unknown address'}; "
                                f"{HOW_TO_ADMIN}")


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
    how = ("need 'Authorization: Bearer <--api-key>'" if getattr(app.state, "api_key", None)
           else "answer only loopback clients (no --api-key set; set it to call them from "
                "other hosts)")
    log.info("admin routes %s %s", ", ".join(admin_routes(app)), how)
