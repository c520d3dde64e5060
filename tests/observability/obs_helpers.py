"""Helpers of the observability tests: load through the router, restart a killed worker."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pdcore.testing.processes import PDCluster, ServerProcess

ROUTER_HEALTHY_TIMEOUT_S = 120.0


def _one(url: str, i: int) -> None:
    body = {"text": f"Observability check, shared prefix for the cache. Request number {i}.",
            "stream": i % 2 == 1,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text


def send_load(cluster: PDCluster, n: int = 8, concurrency: int = 4) -> None:
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: _one(cluster.url, i), range(n)))


def restart_worker(cluster: PDCluster, server: ServerProcess) -> None:
    server.start().wait_healthy(300)
    deadline = time.monotonic() + ROUTER_HEALTHY_TIMEOUT_S
    while httpx.get(cluster.url + "/health", timeout=10).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not take {server.url} back within "
                               f"{ROUTER_HEALTHY_TIMEOUT_S}s")
        time.sleep(0.2)
