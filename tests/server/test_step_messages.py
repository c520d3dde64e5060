"""The scheduler sends a step's TokenOuts as one message (a list); the HTTP process's receive
loop hands each to its request's queue in order, skips requests it no longer follows, and still
takes a lone TokenOut and control answers (the real zmq sockets of EngineClient). The fake
scheduler sends one list a step too, so every fake-server test streams through that path."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from pdcore.config import ServerArgs
from pdcore.messages.io import ControlResp, TokenOut
from pdcore.runtime.handle import EngineClient


def test_a_steps_list_reaches_each_request_in_order(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/from_scheduler"  # two contexts, as the two processes have

    async def main() -> None:
        client = EngineClient(ServerArgs(model_path="unused"))  # type: ignore[arg-type]
        ctx = zmq.asyncio.Context()
        sync = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(addr)
        push = sync.socket(zmq.PUSH)
        push.connect(addr)
        client._pull = pull
        qa: asyncio.Queue[TokenOut | None] = asyncio.Queue()
        qb: asyncio.Queue[TokenOut | None] = asyncio.Queue()
        client._reqs = {"a": qa, "b": qb}
        call = asyncio.get_running_loop().create_future()
        client._calls = {"c1": call}
        task = asyncio.create_task(client._recv_loop())
        try:
            push.send(pickle.dumps([TokenOut("a", [1]), TokenOut("gone", [9]),
                                    TokenOut("b", [5]), TokenOut("a", [2], finished=True)]))
            push.send(pickle.dumps(TokenOut("b", [6], finished=True)))  # a lone one
            push.send(pickle.dumps(ControlResp("c1", True, {"x": 1})))
            resp = await asyncio.wait_for(call, 5)
            assert resp.data == {"x": 1}
            got_a = [await asyncio.wait_for(qa.get(), 5) for _ in range(2)]
            got_b = [await asyncio.wait_for(qb.get(), 5) for _ in range(2)]
            assert [(o.new_token_ids, o.finished) for o in got_a] == [([1], False), ([2], True)]
            assert [(o.new_token_ids, o.finished) for o in got_b] == [([5], False), ([6], True)]
            assert qa.empty() and qb.empty()  # "gone" went nowhere, nothing doubled
            assert "gone" not in client._reqs
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            push.close(0)
            pull.close(0)
            sync.term()
            ctx.term()

    asyncio.run(main())


def test_streamed_and_whole_answers_keep_the_request_id_and_are_counted(fake_server: Any
                                                                       ) -> None:
    """The headers middleware is pure ASGI now: a stream's chunks pass through unchanged and
    in order, its start carries x-request-id, the count sees its status."""
    c = fake_server.client
    body = {"prompt": "one two three four", "max_tokens": 8, "stream": True}
    with c.stream("POST", "/v1/completions", json=body, headers={"x-request-id": "r-42"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "r-42"
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    whole = c.post("/v1/completions", json={**body, "stream": False},
                   headers={"x-request-id": "r-43"})
    assert whole.headers["x-request-id"] == "r-43"
    assert streamed == whole.json()["choices"][0]["text"] != ""
    assert "x-request-id" not in c.get("/health").headers
    bad = c.post("/v1/completions", json={**body, "max_tokens": -5})
    assert bad.status_code == 400
    text = c.get("/metrics").text
    assert 'pdserve_requests_total{route="/v1/completions",status="200"}' in text
    assert 'pdserve_requests_total{route="/v1/completions",status="400"}' in text
