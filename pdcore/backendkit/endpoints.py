"""Peer endpoints that are a plain "host:port" (a session id, an RPC address)."""

from __future__ import annotations

from pdcore.errors import TransferError


def host_port(peer_endpoint: bytes, owner: str, form: str = "host:port") -> str:
    """The endpoint blob as "host:port" text, port in 1..65535; TransferError naming the backend
    (`owner`) and the expected `form` otherwise."""
    try:
        target = bytes(peer_endpoint).decode("ascii")
    except UnicodeDecodeError:
        raise TransferError(f"{owner} peer endpoint {peer_endpoint!r} is not '{form}'") from None
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"{owner} peer endpoint {target!r} is not '{form}'")
    return target
