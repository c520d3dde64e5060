from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fake_workers import FakeWorker, ServerThread

from pdcore.router.app import create_app
from pdcore.router.config import RouterConfig


class RunningRouter:
    def __init__(self, config: RouterConfig) -> None:
        self.app = create_app(config)
        self.state = self.app.state.router
        self.server = ServerThread(self.app).start()
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=20)

    def wait_for(self, path: str, status: int = 200, timeout: float = 10.0) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while True:
            resp = self.client.get(path)
            if resp.status_code == status or time.monotonic() > deadline:
                assert resp.status_code == status, f"{path} stayed {resp.status_code}: {resp.text}"
                return resp
            time.sleep(0.05)

    def worker_state(self, url: str) -> dict[str, Any]:
        for w in self.client.get("/workers").json()["workers"]:
            if w["url"] == url:
                return w
        raise KeyError(url)

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def fake_worker() -> Iterator[Callable[..., FakeWorker]]:
    started: list[FakeWorker] = []

    def make(role: str, name: str = "", **kwargs: Any) -> FakeWorker:
        worker = FakeWorker(role=role, name=name or f"{role[0]}{len(started)}", **kwargs).start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop()


@pytest.fixture
def router() -> Iterator[Callable[..., RunningRouter]]:
    started: list[RunningRouter] = []

    def make(
        prefill: list[tuple[FakeWorker, int | None]], decode: list[FakeWorker],
        wait_ready: bool = True, **kwargs: Any,
    ) -> RunningRouter:
        kwargs.setdefault("policy", "round_robin")
        kwargs.setdefault("request_timeout_secs", 20.0)
        config = RouterConfig(
            pd_disaggregation=True,
            prefill=[(w.url, port) for w, port in prefill],
            decode=[w.url for w in decode],
            **kwargs,
        )
        running = RunningRouter(config)
        started.append(running)
        if wait_ready:
            running.wait_for("/health")
        return running

    yield make
    for running in started:
        running.stop()
