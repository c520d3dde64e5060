"""Concurrent generate requests per client address on the router (#30 item 3).

One client (one IP) may have at most `--max-concurrent-requests-per-client` generate requests in
flight (default 256; 0 turns it off); the next one gets 429 `too_many_requests` with
`Retry-After: 1` at once, before any worker is chosen, so one client cannot take every decode
slot from the others. A request counts from when its body is whole until its response (a stream
to its last event) is sent: this is an ASGI middleware around the whole call, and the app sees a
request once its body has arrived (`edge/guarded_http.BodyFirst`; until then the port's limit
on each peer's connections still reading their request bounds it, `edge/connections.py`).
Refusals are counted in
`/metrics` (`pdrouter_client_requests_refused_total`), never logged one by one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class PerClientLimit:
    def __init__(self, app: ASGIApp, limit: int, paths: tuple[str, ...], counter: Any) -> None:
        self.app, self.limit, self.paths, self.counter = app, limit, paths, counter
        self.active: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.limit <= 0 or scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        host = (scope.get("client") or ("unknown",))[0]
        if self.active.get(host, 0) >= self.limit:
            self.counter.inc()
            refusal = JSONResponse({"error": {
                "code": "too_many_requests", "type": "rate_limit_error",
                "message": f"this client ({host}) already has {self.limit} requests in flight "
                           "(--max-concurrent-requests-per-client); wait for one to finish"}},
                status_code=429, headers={"retry-after": "1"})
            await refusal(scope, receive, send)
            return
        self.active[host] = self.active.get(host, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.active[host] - 1
            if left:
                self.active[host] = left
            else:
                del self.active[host]
