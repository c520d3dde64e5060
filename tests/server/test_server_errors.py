"""Bad input: HTTP 400 naming the field, and the server stays healthy with no page leaked."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("pages_back")

LONG = "word " * 400  # > 256 tokens, the fake server's context
CHAT = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, json body or raw bytes, expected param)
    ("/generate", b'{"text": "hi", ', "body"),
    ("/generate", b"", "body"),
    ("/generate", b"[1, 2]", "body"),
    ("/generate", {"sampling_params": {"max_new_tokens": 3}}, "text"),
    ("/generate", {"text": "hi", "input_ids": [1, 2]}, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}},
     "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ("/generate", {"text": LONG}, "text"),
    ("/generate", {"text": ["ok", LONG]}, "text[1]"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [1, 10**9]}, "input_ids"),
    ("/generate", {"text": "", "sampling_params": {}}, "text"),
    ("/generate", {"text": ["a", "b"], "bootstrap_room": [1, 2, 3]}, "bootstrap_room"),
    ("/generate", {"text": "a", "bootstrap_port": 70000}, "bootstrap_port"),
    ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": -1},
     "top_logprobs_num"),
    ("/v1/completions", b"{not json", "body"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -2}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/v1/chat/completions", b"]", "body"),
    ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.1}, "temperature"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
     "sampling_params.max_new_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{c[0]}:{c[2]}:{i}"
                                                         for i, c in enumerate(CASES)])
def test_bad_input_is_400_naming_the_field(fake_server, path, body, param):
    c = fake_server.client
    if isinstance(body, bytes):
        resp = c.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = c.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    if param != "body":
        assert param.split(".")[-1].split("[")[0] in err["message"], err["message"]
    assert c.get("/health").status_code == 200


def test_server_still_generates_after_bad_input(fake_server):
    c = fake_server.client
    for _ in range(3):
        assert c.post("/generate", content=b"{", headers={"content-type":
                                                          "application/json"}).status_code == 400
    r = c.post("/generate", json={"text": "still fine", "sampling_params": {"max_new_tokens": 9}})
    assert r.status_code == 200 and r.json()["text"] == "still fine"


def test_unknown_route_is_404(fake_server):
    assert fake_server.client.post("/v1/nothing", json={}).status_code == 404


def test_a_failures_code_reaches_the_error_body() -> None:
    """#46: a request the engine failed for a named reason (D: its prefill instance restarted)
    carries the code from the scheduler's output to the HTTP answer's error.code, where the
    router reads it; without one the code stays the HTTP status."""
    import json

    from pdcore.engine.sched.outputs import take_output
    from pdcore.engine.sched.request import Phase, Req
    from pdcore.engine.sched.sampler import SampleState
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime import EngineError
    from pdcore.server.http_errors import engine_error_response

    req = Req("r", [1, 2], SampleState.create(SamplingParams(), [1, 2]))
    req.phase, req.error, req.error_status = Phase.FINISHED, "prefill x restarted", 502
    req.error_code = "peer_restarted"  # what Scheduler.fail(req, message, status, code) sets
    out = take_output(req)
    assert out is not None and out.error_code == "peer_restarted"
    body = json.loads(engine_error_response(
        EngineError(out.error, out.error_status, code=out.error_code)).body)
    assert body["error"]["code"] == "peer_restarted" and "restarted" in body["error"]["message"]
    plain = json.loads(engine_error_response(EngineError("boom", 500)).body)
    assert plain["error"]["code"] == 500
