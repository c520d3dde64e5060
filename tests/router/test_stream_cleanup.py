"""A stream's clean-up runs to its end when the client goes away (edge/streams.py).

Starlette cancels a streaming response's task through an anyio cancel scope, which cancels it
again at every await until it leaves. Clean-up that awaits (closing the decode connection,
closing the body generator) was cut short there: CI of a8ab52a saw a decode server generate to
max_tokens for a client that had gone (pages not back after 15 s). Each test first shows the
hazard with the plain code, then that the fixed path completes.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest
from starlette.responses import StreamingResponse

from pdcore.edge.streams import ClosingStreamingResponse, finish
from pdcore.router.circuit import CircuitBreaker
from pdcore.router.metrics import RouterMetrics
from pdcore.router.upstream import DecodeLeg
from pdcore.router.workers import Worker


class SlowResponse:
    """Stands in for httpx.Response: aclose() needs a few loop turns (a socket close does)."""

    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0.01)
        self.closed = True


async def _cancelled_in_scope(cleanup) -> None:  # type: ignore[no-untyped-def]
    """Run `try: wait forever finally: await cleanup()` in a task group, then cancel it as
    Starlette does when the client disconnects."""
    async def body() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await cleanup()

    async with anyio.create_task_group() as tg:
        tg.start_soon(body)
        await asyncio.sleep(0.05)
        tg.cancel_scope.cancel()
    await asyncio.sleep(0.3)  # what was shielded finishes meanwhile


def test_a_plain_await_in_finally_is_cut_short_by_the_cancel_scope() -> None:
    resp = SlowResponse()
    asyncio.run(_cancelled_in_scope(resp.aclose))
    assert not resp.closed  # the hazard this file is about; if anyio changes, so may the fix


def test_finish_runs_the_cleanup_to_its_end_under_the_cancel_scope() -> None:
    resp = SlowResponse()
    asyncio.run(_cancelled_in_scope(lambda: finish(resp.aclose())))
    assert resp.closed


def test_decode_leg_release_closes_the_connection_when_cancelled() -> None:
    async def main() -> tuple[bool, int]:
        worker = Worker("http://127.0.0.1:1", "decode", CircuitBreaker(3, 1, 1.0))
        leg = DecodeLeg(worker, RouterMetrics())
        resp = SlowResponse()
        leg._resp = resp  # type: ignore[assignment]
        await _cancelled_in_scope(leg.release)
        return resp.closed, worker.in_flight

    closed, in_flight = asyncio.run(main())
    assert closed, "the decode connection stayed open: D would generate for nobody"
    assert in_flight == 0


def _scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST",
            "path": "/generate", "headers": []}


async def _client_leaves_while_send_blocks(cls: type[StreamingResponse]) -> list[str]:
    """The body generator is parked at a `yield` while send() waits on a full socket; then the
    client disconnects. Returns what the generator's clean-up recorded by the time the response
    call returned."""
    events: list[str] = []

    async def body():  # type: ignore[no-untyped-def]
        try:
            n = 0
            while True:
                n += 1
                yield b"data: %d\n\n" % n
        finally:
            events.append("closed")  # where the engine request is aborted

    gone = asyncio.Event()

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    sent = 0

    async def send(message: dict) -> None:
        nonlocal sent
        sent += 1
        if sent == 3:  # write paused: the client stopped reading, then leaves
            gone.set()
            await asyncio.sleep(3600)

    response = cls(body(), media_type="text/event-stream")
    await asyncio.wait_for(response(_scope(), receive, send), 10)
    seen = list(events)
    del response
    return seen


@pytest.mark.parametrize("cls,closed", [(StreamingResponse, False),
                                        (ClosingStreamingResponse, True)])
def test_the_body_generator_is_closed_when_the_client_leaves(cls, closed) -> None:  # type: ignore[no-untyped-def]
    assert (asyncio.run(_client_leaves_while_send_blocks(cls)) == ["closed"]) is closed
