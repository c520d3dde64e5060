"""Helpers for PD tests with tensor parallelism: a fleet of prefill/decode servers with
different TP sizes, and requests sent to an explicit (P, D) pair the way the router does."""

from __future__ import annotations

import importlib.util
import random
import threading
from typing import Any

import httpx
import pytest

from pdcore.testing.processes import ServerProcess, free_port

NEW = 16  # new tokens per request in the server tests
FAST_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "64",  # the 4 GiB default is for accelerators
}
STAGING = {"SGLANG_DISAGG_STAGING_BUFFER": "1"}
FLAGS = ("--max-total-tokens", "16384", "--page-size", "4", "--chunked-prefill-size", "4096")


class Fleet:
    """Named P/D servers (`p2s`: prefill, TP 2, staging on), started together. A spec is
    (mode, TP size, extra env) or (mode, TP size, extra env, extra flags)."""

    def __init__(self, backend: str, model: str, specs: dict[str, tuple[Any, ...]],
                 env: dict[str, str] | None = None) -> None:
        self.servers: dict[str, ServerProcess] = {}
        self.boot = {name: free_port() for name, spec in specs.items() if spec[0] == "prefill"}
        # requests name P's bootstrap by hand (no router): decode must trust those addresses
        trusted = ",".join(f"127.0.0.1:{b}" for b in self.boot.values())
        for name, (mode, tp, extra_env, *more) in specs.items():
            flags = [*FLAGS, "--model-path", model, "--disaggregation-transfer-backend", backend,
                     "--disaggregation-mode", mode, "--tp-size", str(tp), *(more[0] if more
                                                                             else ())]
            if mode == "prefill":
                flags += ["--disaggregation-bootstrap-port", str(self.boot[name])]
            elif trusted:
                flags += ["--disaggregation-trusted-prefill", trusted]
            self.servers[name] = ServerProcess(*flags, env={**FAST_ENV, **(env or {}),
                                                            **extra_env})

    def start(self, timeout: float = 400.0) -> Fleet:
        try:
            for s in self.servers.values():
                s.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __getitem__(self, name: str) -> ServerProcess:
        return self.servers[name]

    def load(self, name: str) -> dict[str, Any]:
        return httpx.get(self.servers[name].url + "/get_load", timeout=10).json()[0]

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


def pd_generate(fleet: Fleet, p: str, d: str, ids: list[int], max_new_tokens: int = 16,
                timeout: float = 120.0) -> tuple[int, dict[str, Any] | str]:
    """Send the same request to P and D (bootstrap fields set as the router does); D's answer."""
    room = random.randrange(1 << 62)
    body = {"input_ids": ids, "bootstrap_host": "127.0.0.1", "bootstrap_port": fleet.boot[p],
            "bootstrap_room": room,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    p_out: list[Any] = []
    t = threading.Thread(target=lambda: p_out.append(
        httpx.post(fleet[p].url + "/generate", json=body, timeout=timeout)), daemon=True)
    t.start()
    r = httpx.post(fleet[d].url + "/generate", json=body, timeout=timeout)
    t.join(timeout)
    return r.status_code, (r.json() if r.status_code == 200 else r.text)


# the vendor backends on loopback: the module whose presence says the SDK is installed, and the
# environment that keeps it on 127.0.0.1 and quiet
PLUGIN_BACKENDS = {
    "mooncake": ("mooncake", {"MC_LOG_LEVEL": "WARNING", "MOONCAKE_PROTOCOL": "tcp"}),
    "nixl": ("nixl._api", {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib",
                           "NIXL_LOG_LEVEL": "WARN"}),
}


def plugin_backend_env(backend: str) -> dict[str, str]:
    """The backend's loopback environment; skips the test where its SDK is not installed
    (looked up, not imported: importing an SDK into the test process has exit-time effects)."""
    module, env = PLUGIN_BACKENDS[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip(f"{module} not installed")
    return env
