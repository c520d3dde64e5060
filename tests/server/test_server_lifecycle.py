"""Disconnects, timeouts, start-up and scheduler death, prefill/decode shapes (stand-in
scheduler)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_server import FakeServer, wait_pages, wait_status


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """Environment for the scheduler process spawned inside the block."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def slow_server(tiny_llama_dir: Path) -> Iterator[FakeServer]:
    with env(FAKE_TOKEN_DELAY="0.02"):  # 250 tokens take 5 s
        server = FakeServer(tiny_llama_dir, context_length=512)
    yield server
    server.stop()


LONG_GEN = {"text": "a long generation", "sampling_params": {"max_new_tokens": 250,
                                                             "ignore_eos": True}}


def _num_reqs(server: FakeServer) -> int:
    return int(server.client.get("/get_load").json()[0]["num_reqs"])


def test_stream_disconnect_frees_pages(slow_server):
    start = slow_server.free_pages()
    with httpx.Client(base_url=slow_server.url, timeout=30) as c, \
            c.stream("POST", "/generate", json={**LONG_GEN, "stream": True}) as resp:
        lines = resp.iter_lines()  # kept referenced: dropping it closes the connection
        data = [next(lines) for _ in range(6)]
        assert sum(x.startswith("data: ") for x in data) == 3
        assert slow_server.free_pages() < start and _num_reqs(slow_server) == 1
    t0 = time.monotonic()
    assert wait_pages(slow_server, start, timeout=3) == start
    assert time.monotonic() - t0 < 3 and _num_reqs(slow_server) == 0


def test_non_stream_disconnect_frees_pages(slow_server):
    start = slow_server.free_pages()
    with httpx.Client(base_url=slow_server.url, timeout=0.5) as c, \
            pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json=LONG_GEN)
    assert wait_pages(slow_server, start, timeout=3) == start
    assert _num_reqs(slow_server) == 0


def test_openai_stream_disconnect_frees_pages(slow_server):
    start = slow_server.free_pages()
    body = {"prompt": "x", "max_tokens": 250, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.Client(base_url=slow_server.url, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json=body) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i == 4:
                break
    assert wait_pages(slow_server, start, timeout=3) == start


def test_request_timeout_is_504_and_frees_pages(slow_server):
    start = slow_server.free_pages()
    r = slow_server.client.post("/generate", json={**LONG_GEN, "timeout": 0.3})
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    # the request's own timeout: marked as the client's doing, so a router neither retries it
    # nor counts it against this server's circuit
    assert r.headers["x-pd-error-origin"] == "client"
    r = slow_server.client.post("/v1/completions", json={
        "prompt": "a long generation", "max_tokens": 250, "ignore_eos": True, "timeout": 0.3})
    assert r.status_code == 504 and r.headers["x-pd-error-origin"] == "client"
    assert wait_pages(slow_server, start, timeout=3) == start


def test_stop_string_aborts_scheduler_request(slow_server):
    """A stop string ends the request in the HTTP process; the scheduler must drop it too."""
    start = slow_server.free_pages()
    t0 = time.monotonic()
    r = slow_server.client.post("/generate", json={
        "text": "a b c d e", "sampling_params": {"max_new_tokens": 250, "ignore_eos": True,
                                                 "stop": " c"}})
    assert r.json()["text"] == "a b" and time.monotonic() - t0 < 2
    assert wait_pages(slow_server, start, timeout=2) == start


def test_health_503_while_starting_then_200(tiny_llama_dir):
    with env(FAKE_READY_DELAY="3"):
        server = FakeServer(tiny_llama_dir, wait=False)
        try:
            r = server.client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "starting"
            g = server.client.post("/generate", json={"text": "hi"})
            assert g.status_code == 503 and "starting" in g.json()["error"]["message"]
            wait_status(server.client, "/health", 200, timeout=60)
        finally:
            server.stop()


def test_start_failure_is_reported(tiny_llama_dir):
    with env(FAKE_READY_FAIL="weights are corrupt"):
        server = FakeServer(tiny_llama_dir, wait=False)
    try:
        deadline = time.monotonic() + 60
        while server.engine.state.value == "starting" and time.monotonic() < deadline:
            time.sleep(0.05)
        r = server.client.get("/health")
        assert r.status_code == 503 and "weights are corrupt" in r.json()["error"]
        g = server.client.post("/v1/completions", json={"prompt": "hi"})
        assert g.status_code == 503 and "weights are corrupt" in g.json()["error"]["message"]
    finally:
        server.stop()


def test_scheduler_death_fails_pending_requests(tiny_llama_dir):
    with env(FAKE_TOKEN_DELAY="0.02"):
        server = FakeServer(tiny_llama_dir)
    results: dict[str, Any] = {}

    def non_stream() -> None:
        results["plain"] = server.client.post("/generate", json=LONG_GEN)

    def stream() -> None:
        with server.client.stream("POST", "/generate", json={**LONG_GEN, "stream": True}) as r:
            results["stream"] = list(r.iter_lines())

    threads = [threading.Thread(target=non_stream), threading.Thread(target=stream)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while _num_reqs(server) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        pid = server.engine.pid
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(10)
        plain = results["plain"]
        assert plain.status_code == 503 and "scheduler process died" in plain.text
        events = [x for x in results["stream"] if x]
        assert events[-1] == "data: [DONE]" and "scheduler process died" in events[-2]
        h = server.client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "dead"
        assert server.client.post("/generate", json={"text": "x"}).status_code == 503
    finally:
        server.stop()


def test_shutdown_stops_scheduler(tiny_llama_dir):
    server = FakeServer(tiny_llama_dir)
    proc = server.engine._proc
    assert proc.is_alive()
    server.stop()
    assert not proc.is_alive()


def test_prefill_mode_returns_one_token(tiny_llama_dir):
    server = FakeServer(tiny_llama_dir, disaggregation_mode="prefill")
    try:
        r = server.client.post("/generate", json={
            "text": "prefill this", "sampling_params": {"max_new_tokens": 50},
            "return_logprob": True, "logprob_start_len": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_room": 7})
        m = r.json()["meta_info"]
        assert m["completion_tokens"] == 1
        assert len(m["input_token_logprobs"]) == len(server.tokenizer.encode("prefill this"))
        c = server.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30})
        assert c.json()["usage"]["completion_tokens"] == 1
        assert server.client.get("/health_generate").status_code == 200
        hg = server.last_requests()[-1]
        assert (hg["route"]["host"], hg["route"]["room"]) == ("2.2.2.2", 0)
        assert server.client.get("/server_info").json()["disaggregation_mode"] == "prefill"
    finally:
        server.stop()


def test_decode_mode_sends_the_samples_of_a_prompt_in_one_message(tiny_llama_dir):
    """n > 1 on a decode server: samples 1..n-1 travel inside sample 0's GenerateReq (`forks`,
    each forking from it), one message per prompt, so the scheduler parks them before sample
    0's KV can arrive (s8c's race: sent one by one, a late sibling failed)."""
    server = FakeServer(tiny_llama_dir, disaggregation_mode="decode")
    try:
        before = len(server.last_requests())
        r = server.client.post("/generate", json={
            "text": ["one", "two"], "sampling_params": {"n": 3, "max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert len(r.json()) == 6 and all(o["meta_info"]["completion_tokens"] == 2
                                          for o in r.json())
        sent = server.last_requests()[before:]
        assert len(sent) == 2 and sent[0]["input_ids"] != sent[1]["input_ids"]  # one a prompt
        for m in sent:
            assert m["route"] is None and len(m["forks"]) == 2
            assert all(f.route.fork_of == m["rid"] and f.input_ids == m["input_ids"]
                       for f in m["forks"])
        ids = {o["meta_info"]["id"] for o in r.json()}
        assert ids == {m["rid"] for m in sent} | {f.rid for m in sent for f in m["forks"]}
    finally:
        server.stop()


def test_decode_mode_sends_the_samples_to_sample_0s_dp_replica(tiny_llama_dir):
    """--dp-size 2 on a decode server: each sample's own generate() call finds the queue sample
    0's replica registered for it (the balancer alternates, so a sample picking its own
    replica would find none and answer 500)."""
    server = FakeServer(tiny_llama_dir, disaggregation_mode="decode", dp_size=2)
    try:
        for _ in range(3):
            r = server.client.post("/generate", json={
                "text": "one", "sampling_params": {"n": 3, "max_new_tokens": 2}})
            assert r.status_code == 200, r.text
            assert [o["meta_info"]["completion_tokens"] for o in r.json()] == [2] * 3
    finally:
        server.stop()


def test_decode_mode_always_has_input_logprobs(tiny_llama_dir):
    server = FakeServer(tiny_llama_dir, disaggregation_mode="decode")
    try:
        r = server.client.post("/generate", json={"text": "decode", "sampling_params":
                                                  {"max_new_tokens": 2}})
        assert r.json()["meta_info"]["input_token_logprobs"] == []
        r = server.client.post("/generate", json={"text": "decode", "return_logprob": True,
                                                  "sampling_params": {"max_new_tokens": 2}})
        m = r.json()["meta_info"]
        assert m["input_token_logprobs"] == [] and len(m["output_token_logprobs"]) == 2
    finally:
        server.stop()
