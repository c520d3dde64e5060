"""Drain of one server (#49 item 2), on its real app with an engine stand-in: the admin call
`POST /drain` (admin key only) turns /health into 503 "draining", refuses new generate requests
with 503 code `draining` and the header the router acts on, shows it on /metrics, and calls
the runner's exit once nothing is in flight (the engine's own queues included). The whole path
with real servers under load: tests/pd/test_rolling_restart.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from pdcore.config import ServerArgs
from pdcore.messages.codes import DRAINING_HEADER
from pdcore.messages.info import EngineInfo
from pdcore.runtime import EngineState

ADMIN = "the-operators-admin-key"


class _Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.args, self.ready, self.state, self.error, self.info = (
            args, True, EngineState.READY, None, EngineInfo())
        self.busy = 1  # requests the scheduler still holds (a room still transferring)

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def stats(self, timeout: float = 10.0) -> Any:
        from pdcore.runtime import EngineError

        raise EngineError("no stats here")

    async def control(self, kind: str, *a: Any, **kw: Any) -> dict[str, Any]:
        return {"num_running_reqs": 0, "num_waiting_reqs": 0,
                "disagg_transfer_queue": self.busy}


def test_post_drain_refuses_new_work_and_exits_once_idle(tiny_llama_dir: Path) -> None:
    from pdcore.server.app import create_app

    args = ServerArgs(model_path=str(tiny_llama_dir), disaggregation_mode="prefill",
                      admin_api_key=ADMIN, drain_timeout=30.0)
    engine = _Engine(args)
    app = create_app(args, engine=engine)  # type: ignore[arg-type]
    exits: list[bool] = []
    app.state.drain.on_drained = exits.append
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/drain").status_code == 401  # admin only
        assert c.post("/drain", headers={"authorization": "Bearer nope"}).status_code in (401,
                                                                                        403)
        assert not app.state.drain.draining
        r = c.post("/drain", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200 and r.json()["draining"] is True, r.text
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "draining", h.text
        assert h.headers.get(DRAINING_HEADER) == "1"
        g = c.post("/generate", json={"text": "hi"})
        assert g.status_code == 503 and g.json()["error"]["code"] == "draining", g.text
        assert g.headers.get(DRAINING_HEADER) == "1"
        assert "pdserve_draining 1.0" in c.get("/metrics").text
        time.sleep(0.5)
        assert exits == [], "exited while the engine still held a request"
        engine.busy = 0
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exits == [True]
        again = c.post("/drain", headers={"authorization": f"Bearer {ADMIN}"})
        assert again.json()["already"] is True


def test_the_heap_is_trimmed_when_the_last_request_ends(monkeypatch) -> None:
    """DrainMiddleware hands the freed heap back (trim_heap) once nothing is in flight, on the
    loop's next turn: not while a request still runs, once when two overlapping ones end, and
    not when a request began before that turn (#48: ~7 MiB the HTTP process kept after a
    batch). Other routes trim nothing."""
    import asyncio

    from pdcore.server import drain as drain_mod

    trims: list[int] = []
    d = drain_mod.Drain(30.0)
    monkeypatch.setattr(drain_mod, "trim_heap", lambda: trims.append(d.in_flight))
    gates: dict[str, asyncio.Event] = {}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["path"] == "/generate":
            await gates[scope["rid"]].wait()

    mw = drain_mod.DrainMiddleware(app, d, {"/generate"})

    async def main() -> None:
        def call(rid: str) -> asyncio.Task:
            gates[rid] = asyncio.Event()
            return asyncio.create_task(mw({"type": "http", "path": "/generate", "rid": rid},
                                          None, None))

        a, b = call("a"), call("b")
        await asyncio.sleep(0.01)
        assert d.in_flight == 2
        gates["a"].set()
        await a
        await asyncio.sleep(0.01)
        assert trims == [] and d.in_flight == 1  # b still runs
        gates["b"].set()
        await b
        await asyncio.sleep(0.01)
        assert trims == [0] and d.in_flight == 0
        await mw({"type": "http", "path": "/health"}, None, None)
        await asyncio.sleep(0.01)
        assert trims == [0]
        d.in_flight = 1  # a request began after the last one ended, before the trim's turn
        mw._trim_if_idle()
        assert trims == [0]

    asyncio.run(main())
