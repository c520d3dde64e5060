"""In-process servers for tests: uvicorn in a thread, and the app around the echo stand-in
scheduler (fake_scheduler.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fake_scheduler import run_fake_scheduler

from pdcore.config import ServerArgs
from pdcore.server.app import create_app


class ServerThread:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        self.loop.close()

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        """Run a coroutine on the server's event loop (e.g. engine.control(...))."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def wait_status(client: httpx.Client, path: str, status: int = 200, timeout: float = 60.0
                ) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        resp = client.get(path)
        if resp.status_code == status:
            return resp
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} stayed {resp.status_code}: {resp.text}")
        time.sleep(0.05)


class FakeServer:
    def __init__(self, model_dir: Path, wait: bool = True, **arg_overrides: Any) -> None:
        self.args = ServerArgs(model_path=str(model_dir), **arg_overrides)
        self.app = create_app(self.args, scheduler_target=run_fake_scheduler)
        self.engine = self.app.state.engine
        self.thread = ServerThread(self.app).start()
        self.url = self.thread.url
        self.client = httpx.Client(base_url=self.url, timeout=30)
        if wait:
            deadline = time.monotonic() + 60
            while self.engine.state.value == "starting" and time.monotonic() < deadline:
                time.sleep(0.02)
            wait_status(self.client, "/health", timeout=1)

    def last_requests(self) -> list[dict[str, Any]]:
        """The GenerateReqs the fake scheduler received, oldest first (at most 64)."""
        return self.thread.call(self.engine.control("last_requests"))["reqs"]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def free_pages(self) -> int:
        resp = self.client.get("/get_load")
        assert resp.status_code == 200, resp.text
        return int(resp.json()[0]["num_pages_free"])

    def stop(self) -> None:
        self.client.close()
        self.thread.stop()


def wait_pages(server: Any, expected: int, timeout: float = 5.0) -> int:
    """Aborts reach the scheduler asynchronously: poll until free pages == expected."""
    deadline = time.monotonic() + timeout
    while True:
        now = server.free_pages()
        if now == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.05)
