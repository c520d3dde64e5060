"""The uvicorn side of the HTTP ports' connection gate (`pdcore.edge.connections`): the h11
protocol class that tells a `PortGate` what each connection does (opened, read from, headers
complete, body complete, response sent, lost), and `BodyFirst`, which keeps a request away from
the app until its body is whole."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from pdcore.edge.limits import max_request_bytes
from pdcore.netguard import peer_key

HOLD_BYTES = 1 << 16  # BodyFirst: a body's first 64 KiB wait for the rest below the app


class BodyFirst:
    """The app (its middleware, its route) sees a request once its body is whole, or once
    HOLD_BYTES of it arrived: until then the request waits in this one cheap coroutine. A decode
    server's middleware stack costs about a millisecond of its event loop per request (task
    groups, a disconnect watcher), paid again when the request goes; 5,000 slow bodies
    connecting and being evicted kept the loop too busy to answer `/health` for 10 s. A body
    declared over the size limit goes to the app at once (413 before a byte is read); a client
    gone before its body was whole is answered by nobody."""

    def __init__(self, app: Any) -> None:
        self.app, self.limit = app, max_request_bytes()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not (length.isdigit() and 0 < int(length) <= self.limit):
            return await self.app(scope, receive, send)
        held, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            held.append(msg)
            size += len(msg.get("body", b""))
            if msg["type"] != "http.request" or not msg.get("more_body") or size >= HOLD_BYTES:
                break

        async def replay() -> Any:
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)


def guarded_protocol(gate: Any) -> type:
    """uvicorn's h11 protocol, reporting to `gate` (a `connections.PortGate`), its app behind
    `BodyFirst`."""
    wrapped: dict[int, BodyFirst] = {}

    class GuardedH11Protocol(H11Protocol):
        pd_peer = "unknown"
        pd_start = 0.0
        pd_bytes = 0
        pd_body_bytes = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            app = wrapped.get(id(self.app))
            if app is None:
                app = wrapped[id(self.app)] = BodyFirst(self.app)
            self.app = app

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self.pd_peer = peer_key(str(peer[0])) if isinstance(peer, tuple) else "unix"
            if not gate.opened(self):
                transport.abort()

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            if before is not None and before.response_complete and self not in gate.pending:
                gate.waiting(self)  # the next request on a kept-alive connection
            if not self.pd_bytes:
                gate.read_from(self)
            self.pd_bytes += len(data)
            reading = self in gate.reading
            if reading:
                self.pd_body_bytes += len(data)
            super().data_received(data)
            cycle = self.cycle
            if cycle is not before and cycle is not None:
                gate.headers_done(self)
            elif reading and not cycle.more_body:
                gate.body_done(self)

        def pause_writing(self) -> None:
            super().pause_writing()
            gate.write_paused(self, True)

        def resume_writing(self) -> None:
            super().resume_writing()
            gate.write_paused(self, False)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                gate.kept_alive(self)

        def connection_lost(self, exc: Exception | None) -> None:
            gate.lost(self)
            super().connection_lost(exc)

    return GuardedH11Protocol
