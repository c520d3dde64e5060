"""A SmolLM2 server's engine process, after warm-up, holds one copy of the weights: its resident
memory stays within 1.15 x its weights + the KV pool + 300 MB + what importing torch and
transformers costs any Python process (measured here in a fresh interpreter: it is the same
for every model and no part of serving). Weights are what the engine reports holding
(`weight_bytes`: parameters and reordered weights, each storage once); a second copy of them
(originals kept beside reordered weights, or the transformers model kept) breaks the bound."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from pdcore.testing.processes import ServerProcess, spawned_children

MB = 2**20
KV_TOKENS = 8192


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _import_baseline() -> int:
    code = ("import os, torch, transformers; from transformers import AutoConfig; "
            "import pdcore.runtime.scheduler_process; "
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
            "if l.startswith('VmRSS')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, check=True)
    return int(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess("--max-total-tokens", str(KV_TOKENS), "--cpu-omp-threads-bind", "nobind")
    try:
        yield s.wait_healthy(600)
    finally:
        s.stop()


def test_engine_resident_memory_is_one_copy_of_the_weights(server: ServerProcess) -> None:
    for n in (8, 64):  # warm-up: prefill and decode of a few lengths
        r = httpx.post(server.url + "/generate", timeout=300, json={
            "text": "The history of the printing press " * n,
            "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
        assert r.status_code == 200
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    weights = info["weight_bytes"]
    kv = info["kv_bytes_per_token"] * info["max_total_tokens"]
    (engine,) = spawned_children(server.proc.pid)
    rss, base = _rss(engine), _import_baseline()
    bound = 1.15 * weights + kv + 300 * MB + base
    print(f"\nengine RSS {rss / MB:.0f} MiB; weights {weights / MB:.0f} MiB, KV {kv / MB:.0f} "
          f"MiB, torch+transformers import {base / MB:.0f} MiB -> bound {bound / MB:.0f} MiB")
    assert info["kv_cache_dtype"] == "float32" and info["max_total_tokens"] == KV_TOKENS
    assert rss <= bound
