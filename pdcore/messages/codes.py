"""Machine-readable error codes: the `code` of an error body `{"error": {"message", "type",
"param", "code"}}` when a server refuses or fails a request for a reason a caller acts on.

A caller (the router first) tells the reasons apart by this code, never by the message's text,
which is for people and may change. Errors with no named reason keep the HTTP status as their
`code` (what SGLang's servers answer). The values are part of the wire contract: add names,
never rename one.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request was refused or failed (a str: it serialises as its value)."""

    # 403: the request names a PD route (bootstrap host/port/room) this server does not trust:
    # neither signed with the cluster secret nor a trusted prefill address (route_auth.py)
    ROUTE_REFUSED = "route_refused"
    # 403: the room is already claimed by another decode server or request
    ROOM_CLAIMED = "room_claimed"
    # 403: the prompt D announced for a room is not the prompt P holds for it
    PROMPT_MISMATCH = "prompt_mismatch"
    # 502: this server's PD peer (decode for P, prefill for D) failed the request
    PEER_FAILED = "peer_failed"
    # 502: the prefill instance at the route's address restarted: the room died with it
    PEER_RESTARTED = "peer_restarted"


def code_of(body: object) -> str | None:
    """The named code of a parsed error body, or None (no body, no error, a numeric code)."""
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None
