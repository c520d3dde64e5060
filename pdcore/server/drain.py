"""Drain: stop taking requests, finish the ones in flight, then exit (#49 item 2).

1. SIGTERM (the runner's first one) or the admin call `POST /drain` starts it; a second
   SIGTERM / Ctrl-C stops the server at once (uvicorn's own shutdown).
2. While draining, `/health` answers 503 `{"status": "draining", "in_flight": N}` and every
   generate route answers 503 code `draining` with the DRAINING_HEADER: the router takes the
   worker out of rotation at once and retries the request elsewhere, counting no circuit
   failure (router/upstream.py).
3. In flight are the generate requests whose response has not ended (streams until their last
   byte), then the engine's own requests (a prefill's rooms still transferring, a decode's
   requests still waiting for KV: /get_load's counts and PD queues). When both are 0 the
   server exits 0; after --drain-timeout (else $PDSERVE_DRAIN_TIMEOUT_S) it exits anyway:
   uvicorn's shutdown aborts what is left, each stream ending with an error event.
4. Logs say when the drain starts and how many requests were in flight, and how it ended;
   /metrics has `pdserve:draining` and `pdserve:drain_in_flight`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pdcore.env import ENV
from pdcore.messages.codes import DRAINING_HEADER, ErrorCode
from pdcore.messages.io import ControlKind
from pdcore.messages.stats import PD_QUEUES, RankLoad
from pdcore.runtime_env import trim_heap

log = logging.getLogger("pdcore.server.drain")

POLL_S = 0.1


def drain_timeout(flag: float | None) -> float:
    return float(flag) if flag is not None else float(ENV.pdserve_drain_timeout_s)


class Drain:
    """The server's drain state; `app.state.drain`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.in_flight = 0  # generate requests whose response has not ended
        self.started_at = 0.0
        self.task: asyncio.Task[None] | None = None
        self.on_drained: Callable[[bool], None] | None = None  # set by the runner: exit

    def begin(self, engine: Any, why: str) -> bool:
        """Start draining (once; False if it already was)."""
        if self.draining:
            return False
        self.draining, self.started_at = True, time.monotonic()
        log.warning("draining (%s): %d request(s) in flight; new requests get 503; exit when "
                    "they finish or after %g s", why, self.in_flight, self.timeout_s)
        self.task = asyncio.get_running_loop().create_task(self._wait(engine),
                                                           name="pdserve-drain")
        return True

    async def engine_busy(self, engine: Any) -> int:
        """Requests the engine still holds (running, waiting, PD queues); 0 when idle or
        unknown (a dead engine holds nothing to wait for)."""
        if not getattr(engine, "ready", False):
            return 0
        try:
            data = await engine.control(ControlKind.GET_LOAD, timeout=5.0)
        except Exception as e:  # noqa: BLE001 - a busy or dead scheduler: do not wait on it
            log.warning("drain: engine load unavailable: %s", e)
            return 0
        loads = data.get("loads") if isinstance(data.get("loads"), list) else [data]
        busy = 0
        for d in loads:
            r = RankLoad.from_json(d if isinstance(d, dict) else {})
            busy += r.num_running_reqs + r.num_waiting_reqs + sum(
                r.queues.get(q, 0) for q in PD_QUEUES)
        return busy

    async def _wait(self, engine: Any) -> None:
        deadline = self.started_at + self.timeout_s
        clean = False
        while time.monotonic() < deadline:
            if self.in_flight == 0 and await self.engine_busy(engine) == 0:
                clean = True
                break
            await asyncio.sleep(POLL_S)
        took = time.monotonic() - self.started_at
        if clean:
            log.warning("drained in %.1f s: no request in flight; exiting", took)
        else:
            log.error("drain timeout (%g s) passed with %d request(s) in flight: aborting them "
                      "(--drain-timeout)", self.timeout_s, self.in_flight)
        if self.on_drained is not None:
            self.on_drained(clean)


def refusal() -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {"error": {"message": "server is draining (shutting down): send the request to "
                      "another server", "type": "ServiceUnavailable", "param": None,
                      "code": ErrorCode.DRAINING.value}}
    return 503, body, {DRAINING_HEADER: "1"}


class DrainMiddleware:
    """Pure ASGI: counts generate requests until their response's last byte (streams
    included) and refuses new ones while draining. When the last one ends, the heap the
    requests freed goes back to the OS (`trim_heap`, on the loop's next turn, as the engine
    does when it goes idle): glibc keeps it for reuse otherwise, ~7 MiB of this process after
    a batch of 8 that stayed resident at rest (#48)."""

    def __init__(self, app: Any, drain: Drain, routes: set[str] | frozenset[str]) -> None:
        self.app, self.drain, self.routes = app, drain, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.routes:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            import json

            status, body, headers = refusal()
            raw = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                *((k.encode(), v.encode()) for k, v in headers.items())]})
            await send({"type": "http.response.body", "body": raw})
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
            if self.drain.in_flight == 0:
                asyncio.get_running_loop().call_soon(self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        if self.drain.in_flight == 0:  # none began since
            trim_heap()
