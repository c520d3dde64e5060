"""/v1/completions, /v1/chat/completions, /v1/models against the echo stand-in scheduler."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_server_native import sse_events

pytestmark = pytest.mark.usefixtures("pages_back")


def post(server: Any, path: str, **body: Any) -> Any:
    resp = server.client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return sse_events(resp.text) if body.get("stream") else resp.json()


def test_completion_shape(fake_server):
    text = "The quick brown fox"
    r = post(fake_server, "/v1/completions", prompt=text, max_tokens=50, temperature=0)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    (c,) = r["choices"]
    assert c["text"] == text and c["finish_reason"] == "stop" and c["index"] == 0
    n = len(fake_server.tokenizer.encode(text))
    assert r["usage"] == {"prompt_tokens": n, "completion_tokens": n + 1,
                          "total_tokens": 2 * n + 1, "prompt_tokens_details": {"cached_tokens": 0}}
    r = post(fake_server, "/v1/completions", prompt=text)  # OpenAI default max_tokens 16
    assert r["usage"]["completion_tokens"] == n + 1
    r = post(fake_server, "/v1/completions", prompt=text, max_tokens=2)
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 2


def test_completion_prompt_forms_and_n(fake_server):
    tok = fake_server.tokenizer
    ids = tok.encode("token prompt")
    r = post(fake_server, "/v1/completions", prompt=ids, max_tokens=20)
    assert r["choices"][0]["text"] == "token prompt"
    r = post(fake_server, "/v1/completions", prompt=["first one", "second"], max_tokens=20, n=2)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == ["first one"] * 2 + ["second"] * 2
    r = post(fake_server, "/v1/completions", prompt="echo me", max_tokens=20, echo=True)
    assert r["choices"][0]["text"] == "echo meecho me"


def test_completion_stream_and_usage(fake_server):
    text = "stream this completion"
    events = post(fake_server, "/v1/completions", prompt=text, max_tokens=50, n=2, stream=True,
                  stream_options={"include_usage": True})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for e in events[:-1]:
        assert e["object"] == "text_completion" and len(e["choices"]) == 1
        c = e["choices"][0]
        by_index[c["index"]] += c["text"]
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert by_index == {0: text, 1: text} and finishes == {0: "stop", 1: "stop"}


def test_continuous_usage_stats_in_every_chunk(fake_server):
    # guidellm sends stream_options.continuous_usage_stats: every chunk carries the usage of its
    # choices so far (as SGLang and vLLM do); the closing usage chunk still totals all choices
    text = "count these tokens"
    events = post(fake_server, "/v1/completions", prompt=text, max_tokens=50, n=2, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    prompt = events[-1]["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for e in events[:-1]:
        (c,) = e["choices"]
        u = e["usage"]
        assert u["prompt_tokens"] == prompt and u["completion_tokens"] >= seen[c["index"]] > -1
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        seen[c["index"]] = u["completion_tokens"]
    assert sum(seen.values()) == events[-1]["usage"]["completion_tokens"] > 0
    chat = post(fake_server, "/v1/chat/completions", max_tokens=4, stream=True,
                messages=[{"role": "user", "content": "hi"}],
                stream_options={"continuous_usage_stats": True})
    assert chat[0]["usage"]["completion_tokens"] == 0  # the role chunk
    assert chat[-1]["usage"]["completion_tokens"] == 4 and "choices" in chat[-1]


def test_completion_stop_and_logprobs(fake_server):
    r = post(fake_server, "/v1/completions", prompt="alpha beta gamma delta", max_tokens=50,
             stop=[" gamma"], logprobs=2)
    c = r["choices"][0]
    assert c["text"] == "alpha beta" and c["finish_reason"] == "stop"
    assert c["matched_stop"] == " gamma"
    lp = c["logprobs"]
    assert lp["tokens"][:2] == ["alpha", " beta"] and len(lp["token_logprobs"]) == 3
    assert len(lp["top_logprobs"][0]) == 2 and lp["text_offset"][:2] == [0, 5]


def test_chat_shape_template_and_max_completion_tokens(fake_server):
    tok = fake_server.tokenizer
    msgs = [{"role": "user", "content": "hi there"}]
    expected_prompt = tok.encode(tok.apply_chat_template(msgs, tokenize=False,
                                                         add_generation_prompt=True),
                                 add_special_tokens=False)
    r = post(fake_server, "/v1/chat/completions", messages=msgs, max_tokens=len(expected_prompt),
             ignore_eos=True)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert r["usage"]["prompt_tokens"] == len(expected_prompt)
    (c,) = r["choices"]
    assert c["message"]["role"] == "assistant"
    # the echo model repeats the templated prompt: special tokens are skipped in the text
    assert c["message"]["content"] == tok.decode(expected_prompt, skip_special_tokens=True)
    # what sglang-router sends: max_completion_tokens plus its defaults
    r = post(fake_server, "/v1/chat/completions", messages=msgs, model=None, logprobs=False,
             max_completion_tokens=5, max_tokens=50, stream=False, temperature=0.0,
             no_stop_trim=False, ignore_eos=False, continue_final_message=False,
             skip_special_tokens=True, separate_reasoning=True, stream_reasoning=True,
             return_hidden_states=False, bootstrap_host="127.0.0.1", bootstrap_port=8998,
             bootstrap_room=5372346660857392350)
    assert r["usage"]["completion_tokens"] == 5
    assert r["choices"][0]["finish_reason"] == "length"
    seen = fake_server.last_requests()[-1]
    assert seen["route"]["room"] == 5372346660857392350


def test_chat_content_parts(fake_server):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                         {"type": "text", "text": "part two"}]}]
    r = post(fake_server, "/v1/chat/completions", messages=msgs, max_tokens=60, ignore_eos=True)
    assert "part one, part two" in r["choices"][0]["message"]["content"]


def test_chat_stream_n_and_usage(fake_server):
    msgs = [{"role": "user", "content": "stream please"}]
    events = post(fake_server, "/v1/chat/completions", messages=msgs, max_tokens=8, n=2,
                  stream=True, stream_options={"include_usage": True},
                  bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=[1, 2])
    first = events[0]
    assert first["object"] == "chat.completion.chunk"
    assert [c["delta"] for c in first["choices"]] == [{"role": "assistant", "content": ""}] * 2
    content = {0: "", 1: ""}
    done = {}
    for e in events[1:-1]:
        for c in e["choices"]:
            content[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"]:
                done[c["index"]] = c["finish_reason"]
    assert content[0] == content[1] != "" and done == {0: "length", 1: "length"}
    assert events[-1]["usage"]["completion_tokens"] == 16
    # one room per prompt (its first sample's entry): the prompt's KV crosses once, whatever n
    rooms = sorted(r["route"]["room"] for r in fake_server.last_requests()[-2:])
    assert rooms == [1, 1]


def test_chat_logprobs(fake_server):
    msgs = [{"role": "user", "content": "x"}]
    r = post(fake_server, "/v1/chat/completions", messages=msgs, max_tokens=3, logprobs=True,
             top_logprobs=2)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 2
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    events = post(fake_server, "/v1/chat/completions", messages=msgs, max_tokens=3,
                  logprobs=True, stream=True)
    got = [t for e in events[1:] for c in e["choices"] if c["logprobs"]
           for t in c["logprobs"]["content"]]
    assert len(got) == 3 and all(t["top_logprobs"] == [] for t in got)


def test_model_names(fake_server):
    models = fake_server.client.get("/v1/models").json()
    assert models["object"] == "list"
    name = models["data"][0]["id"]
    path = fake_server.args.model_path
    import os
    for model in (name, path, os.path.basename(path), None):
        body = {"prompt": "hi", "max_tokens": 1}
        if model is not None:
            body["model"] = model
        r = post(fake_server, "/v1/completions", **body)
        assert r["model"] == (model or name)


def test_stream_json_is_valid_utf8(fake_server):
    resp = fake_server.client.post("/v1/completions", json={"prompt": "日本語 🙂", "max_tokens": 30,
                                                            "stream": True})
    text = "".join(e["choices"][0]["text"] for e in sse_events(resp.text) if e["choices"])
    assert text == "日本語 🙂"
    assert resp.headers["content-type"].startswith("text/event-stream")
    json.loads(json.dumps(text))
