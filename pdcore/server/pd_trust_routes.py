"""Admin routes of a PD server's route trust (pdcore.route_auth): which prefill bootstrap
addresses it accepts unsigned routes to.

`GET /disaggregation/trusted_prefill` -> {"trusted": [...], "signed_routes": bool, "refused": N};
`POST /disaggregation/trusted_prefill` {"add": ["HOST:PORT", ...], "remove": [...]} registers or
drops addresses (the router does this for its prefill workers when it has no cluster secret to
sign with). Changing trust is an admin act (`edge.auth.require_admin`): it needs
--admin-api-key, and is off without one (the address a call comes from never counts).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pdcore.edge.auth import require_admin
from pdcore.route_auth import RouteGuard
from pdcore.server.http_errors import error_response

router = APIRouter()
PATH = "/disaggregation/trusted_prefill"
MAX_ENTRIES = 256  # addresses in one call


def log_trust_policy(guard: RouteGuard, mode: str, log: logging.Logger) -> None:
    """Say at start which routes this server will act on, and how to change that."""
    signed = ("routes signed with the cluster secret" if guard.key is not None else
              "no signed routes (no --disaggregation-auth-token)")
    trusted = ", ".join(guard.trusted()) or "none"
    own = " and its own bootstrap port" if mode == "prefill" else ""
    log.info("route trust: %s; trusted prefill addresses: %s%s. Any other route is refused "
             "with 403: give router and servers the same --disaggregation-auth-token, or list "
             "prefill servers with --disaggregation-trusted-prefill HOST:PORT (or POST %s)",
             signed, trusted, own, PATH)


def _state(guard: RouteGuard) -> dict[str, Any]:
    return {"trusted": guard.trusted(), "signed_routes": guard.key is not None,
            "refused": guard.refused}


@router.get(PATH)
async def trusted_prefill(request: Request) -> Response:
    return JSONResponse(_state(request.app.state.route_guard))


@router.post(PATH, dependencies=[Depends(require_admin)])
async def change_trusted_prefill(request: Request) -> Response:
    guard: RouteGuard = request.app.state.route_guard
    try:
        body = await request.json()
    except ValueError:
        return error_response("the body must be JSON: {\"add\": [\"HOST:PORT\"], \"remove\": "
                              "[...]}", 400, "body")
    if not isinstance(body, dict):
        return error_response("the body must be a JSON object", 400, "body")
    lists = {k: body.get(k) or [] for k in ("add", "remove")}
    for k, v in lists.items():
        if not isinstance(v, list) or len(v) > MAX_ENTRIES or not all(
                isinstance(x, str) and len(x) <= 300 for x in v):
            return error_response(f"{k} must be a list of at most {MAX_ENTRIES} HOST:PORT "
                                  "strings", 400, k)
    try:
        guard.register(lists["add"])
        guard.unregister(lists["remove"])
    except ValueError as e:
        return error_response(str(e), 400, "add")
    return JSONResponse(_state(guard))
