"""Fan-out through a real router to fake P/D workers: bootstrap fields, batches, merge, stream."""

from __future__ import annotations

import json

from fake_workers import D_LOGPROBS, D_TOKENS, P_LOGPROBS

ROOM_MAX = 2**63 - 1


def _sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_bootstrap_fields_identical_on_both_and_headers_filtered(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode")
    r = router([(p, 8998)], [d])
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    resp = r.client.post("/generate", json=body, headers={
        "Authorization": "Bearer k", "X-Request-ID": "rid-1", "X-Correlation-ID": "c-1",
        "X-Secret": "must-not-pass",
    })
    assert resp.status_code == 200, resp.text
    assert resp.json()["worker"] == d.name  # the client sees decode's answer
    assert resp.headers["x-request-id"] == "rid-1"
    [pb], [db] = p.wait_received(1), d.bodies()
    assert pb == db
    assert pb["bootstrap_host"] == "127.0.0.1" and pb["bootstrap_port"] == 8998
    assert isinstance(pb["bootstrap_room"], int) and 0 <= pb["bootstrap_room"] <= ROOM_MAX
    assert pb["text"] == "hello" and pb["sampling_params"] == body["sampling_params"]
    assert set(pb) == set(body) | {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
    for worker in (p, d):
        headers = worker.received[0].headers
        assert headers["authorization"] == "Bearer k"
        assert headers["x-request-id"] == "rid-1" and headers["x-correlation-id"] == "c-1"
        assert "x-secret" not in headers


def test_null_bootstrap_port_and_fresh_rooms(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode")
    r = router([(p, None)], [d])
    for _ in range(3):
        assert r.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    rooms = [b["bootstrap_room"] for b in p.wait_received(3)]
    assert all(b["bootstrap_port"] is None for b in p.bodies() + d.bodies())
    assert len(set(rooms)) == 3
    assert rooms == [b["bootstrap_room"] for b in d.bodies()]


def test_batches_get_equal_length_lists(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode")
    r = router([(p, 7000)], [d])
    cases = [
        ("/generate", {"text": ["a", "b", "c"]}, 3),
        ("/generate", {"input_ids": [[1, 2], [3, 4]]}, 2),
        ("/v1/completions", {"prompt": ["x", "y"], "max_tokens": 1}, 2),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 2),
    ]
    for k, (path, body, n) in enumerate(cases):
        resp = r.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        p.wait_received(k + 1)
        pb, db = p.bodies(path)[-1], d.bodies(path)[-1]
        assert pb == db
        assert pb["bootstrap_host"] == ["127.0.0.1"] * n
        assert pb["bootstrap_port"] == [7000] * n
        assert len(pb["bootstrap_room"]) == n and len(set(pb["bootstrap_room"])) == n
    # a single token-id prompt is not a batch
    r.client.post("/v1/completions", json={"prompt": [1, 2, 3]})
    p.wait_received(len(cases) + 1)
    assert isinstance(p.bodies("/v1/completions")[-1]["bootstrap_room"], int)


def test_bad_bodies_are_400(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode")
    r = router([(p, None)], [d])
    for content in (b"{not json", b"[1, 2]"):
        resp = r.client.post("/generate", content=content)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"
    resp = r.client.post("/generate", json={"text": []})
    assert resp.status_code == 400 and "empty" in resp.json()["error"]["message"]
    assert p.received == [] and d.received == []


def test_stream_passthrough_without_logprobs(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode")
    r = router([(p, None)], [d])
    with r.client.stream("POST", "/generate", json={"text": "x", "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    chunks = _sse_data(raw)
    assert chunks[-1] == "[DONE]"
    texts = [json.loads(c)["text"] for c in chunks[:-1]]
    assert texts == ["Hel", "Hello", "Hello world"]
    # untouched: decode's own input logprobs only
    assert all(json.loads(c)["meta_info"]["input_token_logprobs"] == D_LOGPROBS for c in chunks[:-1])


def test_logprob_merge_non_stream(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode")
    r = router([(p, None)], [d])
    resp = r.client.post("/generate", json={"text": "x", "return_logprob": True})
    assert resp.status_code == 200
    assert resp.json()["meta_info"]["input_token_logprobs"] == P_LOGPROBS + D_LOGPROBS
    # batch: merged per index
    resp = r.client.post("/generate", json={"text": ["a", "b"], "return_logprob": True})
    items = resp.json()
    assert len(items) == 2
    assert all(i["meta_info"]["input_token_logprobs"] == P_LOGPROBS + D_LOGPROBS for i in items)
    # without logprobs the decode body is returned unchanged
    resp = r.client.post("/generate", json={"text": "x"})
    assert resp.json()["meta_info"]["input_token_logprobs"] == D_LOGPROBS


def test_logprob_merge_stream(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode", stream_interval=0.01)
    r = router([(p, None)], [d])
    body = {"text": "x", "stream": True, "return_logprob": True}
    with r.client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        chunks = _sse_data(resp.read().decode())
    assert chunks[-1] == "[DONE]" and len(chunks) == len(D_TOKENS) + 1
    for c in chunks[:-1]:
        assert json.loads(c)["meta_info"]["input_token_logprobs"] == P_LOGPROBS + D_LOGPROBS


def test_logprobs_wait_for_prefill_error(fake_worker, router):
    p, d = fake_worker("prefill", fail_statuses=[400]), fake_worker("decode")
    r = router([(p, None)], [d])
    resp = r.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    assert resp.status_code == 400  # prefill's error, not decode's success
    assert "injected 400" in resp.text
