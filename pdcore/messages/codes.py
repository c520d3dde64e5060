"""Machine-readable error codes: the `code` of an error body `{"error": {"message", "type",
"param", "code"}}` when a server refuses or fails a request for a reason a caller acts on.

A caller (the router first) tells the reasons apart by this code, never by the message's text,
which is for people and may change. Errors with no named reason keep the HTTP status as their
`code` (what SGLang's servers answer). The values are part of the wire contract: add names,
never rename one.
"""

from __future__ import annotations

import json
from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request was refused or failed (a str: it serialises as its value)."""

    # 403: the request names a PD route (bootstrap host/port/room) this server may not act on:
    # neither signed with the cluster secret nor a trusted prefill address, or its signature
    # does not hold (route_auth.py); a router that does not sign routes answers it by
    # registering its prefill addresses with the server and retrying
    ROUTE_REFUSED = "route_refused"
    # 403: the room is already claimed by another decode server or request
    ROOM_CLAIMED = "room_claimed"
    # 403: the prompt D announced for a room is not the prompt P holds for it
    PROMPT_MISMATCH = "prompt_mismatch"
    # 502: this server's PD peer (decode for P, prefill for D) failed the request
    PEER_FAILED = "peer_failed"
    # 502: the prefill instance at the route's address restarted: the room died with it
    PEER_RESTARTED = "peer_restarted"
    # 503: the server is draining (shutting down): it finishes what it holds and takes no new
    # request; send it to another server (no fault of this one: no circuit counts it)
    DRAINING = "draining"


# set on a draining server's 503 (and its /health): the router retries elsewhere at once
DRAINING_HEADER = "x-pd-draining"


MAX_ERROR_BODY = 65536  # an error body longer than this is no error body of ours


def code_of(body: object) -> str | None:
    """The named code of an error body (its bytes or its parsed JSON), or None: no JSON, no
    `error` object, a numeric code (the HTTP status), or bytes too long to be an error body."""
    if isinstance(body, (bytes, bytearray, str)):
        if len(body) > MAX_ERROR_BODY:
            return None
        try:
            body = json.loads(body)
        except ValueError:
            return None
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None
