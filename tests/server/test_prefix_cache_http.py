"""The prefix cache through a real `pdserve serve` (tiny random Llama, SmolLM2 tokenizer): the
cached tokens every API reports, /flush_cache's rule (refused while a request runs), a client
abort in the middle of a shared-prefix stream, and the cache's /metrics."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdserve_testing import ServerProcess

from pdcore.testing.pages import load_at_rest

PS = 16
STORY = ("The lighthouse keeper had kept the lamp burning for forty years. Every night he "
         "climbed the spiral stairs, trimmed the wick and watched the ships pass. ") * 4


def _serve(model: Path, *flags: str) -> Iterator[ServerProcess]:
    server = ServerProcess("--model-path", str(model), "--max-total-tokens", "16384",
                           "--page-size", str(PS), "--served-model-name", "m",
                           "--log-level", "warning", *flags)
    try:
        server.wait_healthy(timeout=240)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def on(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    yield from _serve(tiny_llama_dir)


@pytest.fixture(scope="module")
def off(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    yield from _serve(tiny_llama_dir, "--disable-radix-cache")


def load(server: ServerProcess) -> dict[str, Any]:
    resp = httpx.get(server.url + "/get_load", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()[0]


def wait_at_rest(server: ServerProcess, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        now = load(server)
        if (load_at_rest(now) and now["num_reqs"] == 0) or time.monotonic() > deadline:
            return now


def generate(server: ServerProcess, text: str, new: int = 8) -> dict[str, Any]:
    resp = httpx.post(server.url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": new, "temperature": 0}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def completion(server: ServerProcess, prompt: str) -> dict[str, Any]:
    resp = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat(server: ServerProcess, content: str) -> dict[str, Any]:
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": [{"role": "system", "content": STORY},
                                   {"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def full_hit(prompt_tokens: int) -> int:
    """What a repeated prompt gets: whole pages, never its last position."""
    return (prompt_tokens - 1) // PS * PS


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("pdserve_", "sglang:")) and not line.startswith("pdserve_kv_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)  # one series per name on one server
    return out


def test_cached_tokens_on_every_api(on, off):
    nonce = uuid.uuid4().hex[:8]  # a prompt no earlier test cached
    text = f"{nonce} {STORY}"
    for server, cached in ((on, True), (off, False)):
        first, again = generate(server, text), generate(server, text)
        assert first["meta_info"]["cached_tokens"] == 0
        n = again["meta_info"]["prompt_tokens"]
        assert again["meta_info"]["cached_tokens"] == (full_hit(n) if cached else 0)
        assert again["text"] == first["text"]
        c1, c2 = completion(server, text + " Again"), completion(server, text + " Again")
        details = c2["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == (full_hit(c2["usage"]["prompt_tokens"])
                                            if cached else 0)
        assert c1["usage"]["prompt_tokens_details"]["cached_tokens"] <= details["cached_tokens"]
        h1, h2 = chat(server, f"{nonce} question one"), chat(server, f"{nonce} question two")
        # the second chat shares the system prompt and the template's head with the first
        got = h2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (got > 0) if cached else (got == 0)
        assert h1["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert generate(on, text)["text"] == generate(off, text)["text"]
    assert load_at_rest(wait_at_rest(on)) and load_at_rest(wait_at_rest(off))


def _stream_until(server: ServerProcess, text: str, chunks: int, inside: Any) -> int:
    """Stream a long generation; after `chunks` chunks call `inside()`, then hang up (the
    client goes away mid-stream). Returns the chunks read."""
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}
    seen = 0
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                assert "error" not in json.loads(line[6:]), line
                if seen == chunks:
                    inside()
                    break
    return seen


def test_flush_cache_refused_while_a_stream_runs(on):
    generate(on, f"{uuid.uuid4().hex} {STORY}")  # something cached
    assert load(on)["radix_cache_pages"] > 0
    answers = []

    def flush() -> None:
        answers.append(httpx.post(on.url + "/flush_cache", timeout=30,
                                  headers=on.admin_headers))

    assert _stream_until(on, STORY, 3, flush) == 3
    refused = answers[0]
    assert refused.status_code == 400, refused.text
    assert "cannot flush" in refused.text and "retry when it is idle" in refused.text
    assert load_at_rest(wait_at_rest(on))
    ok = httpx.post(on.url + "/flush_cache", timeout=30, headers=on.admin_headers)
    assert ok.status_code == 200, ok.text
    assert ok.json()["flushed"] is True and ok.json()["freed_pages"] > 0
    now = load(on)
    assert now["num_pages_free"] == now["num_pages_total"] and now["radix_cache_pages"] == 0


def test_flush_cache_with_the_cache_disabled_says_so(off):
    resp = httpx.post(off.url + "/flush_cache", timeout=30, headers=off.admin_headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["flushed"] is False and "disabled" in resp.json()["message"]


def test_client_abort_mid_stream_of_a_shared_prefix_request(on, off):
    shared = f"{uuid.uuid4().hex} {STORY}"
    generate(on, shared)
    others: list[dict[str, Any]] = []
    threads = [threading.Thread(target=lambda q=q: others.append(generate(on, shared + q, 24)))
               for q in (" First question?", " Second question?")]

    def start_others() -> None:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # hang up once they run beside the stream
        while load(on)["num_reqs"] < 2 and len(others) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    assert _stream_until(on, shared + " A long answer:", 20, start_others) == 20
    for t in threads:
        t.join(120)
    assert len(others) == 2
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in others)
    want = {generate(off, shared + q, 24)["text"] for q in (" First question?",
                                                             " Second question?")}
    assert {o["text"] for o in others} == want
    rest = wait_at_rest(on)
    assert load_at_rest(rest) and rest["num_reqs"] == 0, rest


def test_metrics_show_the_cache(on, off):
    text = f"{uuid.uuid4().hex} {STORY}"
    before = metrics(on)
    generate(on, text)
    hit = generate(on, text)["meta_info"]["cached_tokens"]
    after = metrics(on)
    stats = load(on)
    for name in ("sglang:cache_hit_rate", "pdserve_radix_cache_pages",
                 "pdserve_radix_cache_evictable_pages", "pdserve_radix_cache_evicted_pages_total",
                 "sglang:cached_tokens_total"):
        assert name in after, f"{name} missing from /metrics"
    assert hit > 0
    assert after["sglang:cached_tokens_total"] - before.get("sglang:cached_tokens_total",
                                                             0) == hit
    assert after["sglang:cache_hit_rate"] == pytest.approx(stats["cache_hit_rate"])
    assert 0 < after["sglang:cache_hit_rate"] <= 1
    assert after["pdserve_radix_cache_pages"] == stats["radix_cache_pages"] > 0
    assert after["pdserve_radix_cache_evictable_pages"] == stats["radix_cache_evictable_pages"]
    generate(off, text)
    cold = metrics(off)
    assert cold["sglang:cache_hit_rate"] == 0 and cold["pdserve_radix_cache_pages"] == 0
