"""Fake prefill/decode workers on real uvicorn servers (127.0.0.1, ephemeral ports).

Each `FakeWorker` is a small FastAPI app that records every generation request it receives and
can be told to fail with given statuses, to be slow, to hang until the client disconnects, to
report a load, or to answer /health with another status. Responses mimic SGLang's shapes:
prefill returns `meta_info.input_token_logprobs`; decode streams SSE with one event per token
and always carries `meta_info.input_token_logprobs` (a list).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

P_LOGPROBS = [[None, 1, None], [-0.5, 2, None], [-0.25, 3, None]]
D_LOGPROBS = [[-9.0, 99, None]]
D_TOKENS = ["Hel", "lo", " world"]


class ServerThread:
    """uvicorn serving `app` in a daemon thread on a port bound before start."""

    def __init__(self, app: Any, port: int = 0) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> ServerThread:  # liveness: loaded CI hosts
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeWorker:
    role: str  # "prefill" | "decode"
    name: str = ""
    fail_statuses: list[int] = field(default_factory=list)  # consumed one per request
    fail_message: str = ""  # the failures' error message (default: "injected <status> by ...")
    fail_code: str | int | None = None  # the failures' error code (default: the status)
    fail_headers: dict[str, str] = field(default_factory=dict)  # on the injected failures
    fail_delay: float = 0.0  # before answering an injected failure
    # decode: a 502 `peer_failed` (its prefill peer failed the room, as a real decode server
    # answers when it cannot reach that prefill) for a request naming one of these bootstrap
    # ports: a cut link between this decode and that prefill (router/pairs.py)
    cut_from_ports: set[int] = field(default_factory=set)
    delay: float = 0.0  # before answering a generation request
    hang_until_disconnect: bool = False
    health_status: int = 200
    load_tokens: list[int] = field(default_factory=lambda: [0])  # one entry per DP rank
    stream_interval: float = 0.0
    # streams that send their first event and then wait until the client goes away, as a real
    # decode server does when the KV never comes (its prefill died): consumed one per request
    hang_after_first: int = 0
    received: list[Received] = field(default_factory=list)
    disconnects: int = 0
    flushes: int = 0
    flush_auth: list[str | None] = field(default_factory=list)  # Authorization of each flush
    health_calls: int = 0
    server: ServerThread | None = None

    @property
    def url(self) -> str:
        assert self.server is not None, "start() the worker first"
        return self.server.url

    def bodies(self, path: str | None = None) -> list[dict[str, Any]]:
        return [r.body for r in self.received if path is None or r.path == path]

    def wait_received(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Bodies once `n` requests arrived. Needed for prefill: the router answers the client
        from decode without waiting for the prefill call to be seen."""
        deadline = time.monotonic() + timeout
        while len(self.received) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} got {len(self.received)} requests, wanted {n}")
            time.sleep(0.01)
        return self.bodies()

    def start(self) -> FakeWorker:
        self.server = ServerThread(self.app()).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    # -- responses ---------------------------------------------------------------------------
    def _item(self, body: dict[str, Any], index: int, text: str, final: bool) -> dict[str, Any]:
        room = body.get("bootstrap_room")
        if isinstance(room, list):
            room = room[index]
        lp = P_LOGPROBS if self.role == "prefill" else D_LOGPROBS
        meta = {"id": f"{self.name}-{room}", "input_token_logprobs": list(lp),
                "finish_reason": {"type": "length"} if final else None}
        return {"text": text, "index": index, "worker": self.name, "room": room, "meta_info": meta}

    def _batch(self, body: dict[str, Any]) -> int | None:
        room = body.get("bootstrap_room")
        return len(room) if isinstance(room, list) else None

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(Received(request.url.path, body, dict(request.headers)))
        if self.fail_statuses:
            status = self.fail_statuses.pop(0)
            message = self.fail_message or f"injected {status} by {self.name}"
            if self.fail_delay:
                await asyncio.sleep(self.fail_delay)
            code = status if self.fail_code is None else self.fail_code
            return JSONResponse({"error": {"message": message, "code": code}}, status,
                                headers=self.fail_headers)
        ports = body.get("bootstrap_port")  # one per prompt for a batch
        if set(ports if isinstance(ports, list) else [ports]) & self.cut_from_ports:
            return JSONResponse({"error": {"message": f"{self.name}: cannot reach prefill at "
                                           f"port {ports}",
                                           "code": "peer_failed"}}, 502)
        if self.hang_until_disconnect:
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            self.disconnects += 1
            return Response(status_code=499)
        if self.delay:
            await asyncio.sleep(self.delay)
        n = self._batch(body)
        tokens = D_TOKENS if self.role == "decode" else ["P"]
        if body.get("stream"):
            hang, self.hang_after_first = self.hang_after_first > 0, max(0, self.hang_after_first - 1)
            return StreamingResponse(self._sse(body, n, tokens, request if hang else None),
                                     media_type="text/event-stream")
        items = [self._item(body, i, "".join(tokens), True) for i in range(n or 1)]
        return JSONResponse(items if n else items[0])

    async def _sse(self, body: dict[str, Any], n: int | None, tokens: list[str],
                   hang: Request | None = None):
        text = ""
        for k, tok in enumerate(tokens):
            text += tok
            for i in range(n or 1):
                item = self._item(body, i, text, k == len(tokens) - 1)
                yield f"data: {json.dumps(item)}\n\n".encode()
            if hang is not None:
                try:  # starlette cancels a stream whose client went away
                    while not await hang.is_disconnected():
                        await asyncio.sleep(0.02)
                finally:
                    self.disconnects += 1
                return
            if self.stream_interval:
                await asyncio.sleep(self.stream_interval)
        yield b"data: [DONE]\n\n"

    def app(self) -> FastAPI:
        app = FastAPI()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, self._generate, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            self.health_calls += 1
            return Response(status_code=self.health_status)

        @app.get("/health_generate")
        async def health_generate() -> Response:
            return Response(status_code=self.health_status)

        @app.get("/get_load")
        async def get_load() -> JSONResponse:
            return JSONResponse([
                {"dp_rank": i, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": t}
                for i, t in enumerate(self.load_tokens)
            ])

        @app.get("/get_server_info")
        async def server_info() -> JSONResponse:
            return JSONResponse({"model_path": "/models/tiny", "served_model_name": "tiny",
                                 "disaggregation_mode": self.role, "worker": self.name})

        @app.get("/get_model_info")
        async def model_info() -> JSONResponse:
            return JSONResponse({"model_path": "/models/tiny", "is_generation": True,
                                 "worker": self.name})

        @app.post("/flush_cache")
        async def flush_cache(request: Request) -> Response:
            self.flushes += 1
            self.flush_auth.append(request.headers.get("authorization"))
            return Response("Cache flushed.", 200)

        return app
