"""1P1D + router on SmolLM2 with the nixl backend (UCX) (real server processes on loopback):
greedy output token-identical to the unified engine; D killed mid-request and restarted.

Slow (several minutes on 2 cores): marked `slow`, deselected by default; run with
`python -m pytest -q -m slow`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="nixl not installed")

BACKEND = "nixl"
ENV = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN",
       "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}
FLAGS = ("--max-total-tokens", "24576", "--page-size", "16", "--chunked-prefill-size", "256")
NEW_TOKENS = 48


def generate(url: str, ids: list[int], timeout: float = 600.0) -> httpx.Response:
    body = {"input_ids": ids, "stream": False,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}}
    return httpx.post(url + "/generate", json=body, timeout=timeout)


def outputs(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as ex:
        responses = list(ex.map(lambda p: generate(url, p), prompts))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["output_ids"] for r in responses]


@pytest.fixture(scope="module")
def unified() -> tuple[list[list[int]], list[list[int]]]:
    from pdcore.config import ServerArgs
    from pdcore.engine.io_struct import SamplingParams
    from pdcore.engine.llm_engine import LLMEngine
    from pdcore.engine.tokenizer import load_tokenizer
    from pdcore.testing.prompts import prompt_token_ids

    try:
        prompts = prompt_token_ids(load_tokenizer(ServerArgs()))
        engine = LLMEngine(ServerArgs(max_total_tokens=16384, page_size=16))
    except Exception as e:  # noqa: BLE001 - no model on this machine
        pytest.skip(f"SmolLM2 unavailable: {type(e).__name__}: {e}")
    try:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    finally:
        engine.close()
    return prompts, [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def cluster(unified):
    from pdcore.testing.processes import PDCluster

    c = PDCluster(BACKEND, flags=FLAGS, env=ENV).start()
    yield c
    c.stop()


def test_token_identical_to_unified(cluster, unified) -> None:
    prompts, want = unified
    assert outputs(cluster.url, prompts) == want
    cluster.wait_pages_free()


def test_decode_killed_mid_request_then_restarted(cluster, unified) -> None:
    prompts, want = unified
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    with ThreadPoolExecutor(4) as ex:
        inflight = [ex.submit(generate, cluster.url, prompts[longest], 180.0) for _ in range(4)]
        time.sleep(1.0)
        cluster.decodes[0].kill()
        t0 = time.monotonic()
        for f in inflight:  # every request ends (error or done), none hangs
            f.result(timeout=180)
    assert time.monotonic() - t0 < 180
    cluster.wait_pages_free(timeout=90)  # P freed whatever the dead D had reserved
    cluster.decodes[0].start().wait_healthy(600)
    deadline = time.monotonic() + 120
    while True:  # the router and P pick the restarted D up
        r = generate(cluster.url, prompts[0], timeout=300)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
    assert outputs(cluster.url, prompts) == want
    cluster.wait_pages_free()
