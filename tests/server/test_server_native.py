"""/generate against the echo stand-in scheduler: shapes, streaming, stop handling, logprobs,
batches and the PD fields. The fake echoes the prompt tokens, then EOS."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("pages_back")


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body; asserts the framing (data: lines, blank-line separated, [DONE] last)."""
    chunks = [c for c in body.split("\n\n") if c]
    assert chunks[-1] == "data: [DONE]", chunks[-3:]
    out = []
    for c in chunks[:-1]:
        assert c.startswith("data: "), c
        out.append(json.loads(c[len("data: "):]))
    return out


def gen(server: Any, **body: Any) -> Any:
    resp = server.client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json() if not body.get("stream") else sse_events(resp.text)


def test_echo_text_and_meta(fake_server):
    text = "Hello world, this is pdserve."
    ids = fake_server.tokenizer.encode(text)
    r = gen(fake_server, text=text, sampling_params={"max_new_tokens": 100, "temperature": 0})
    assert r["text"] == text
    assert r["output_ids"] == ids + [2]
    m = r["meta_info"]
    assert m["prompt_tokens"] == len(ids) and m["completion_tokens"] == len(ids) + 1
    assert m["finish_reason"] == {"type": "stop", "matched": 2}
    assert m["cached_tokens"] == 0 and m["e2e_latency"] > 0 and m["id"]
    assert "input_token_logprobs" not in m


def test_max_new_tokens_length(fake_server):
    text = "one two three four five six"
    ids = fake_server.tokenizer.encode(text)
    r = gen(fake_server, text=text, sampling_params={"max_new_tokens": 3})
    assert r["output_ids"] == ids[:3]
    assert r["text"] == fake_server.tokenizer.decode(ids[:3])
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_input_ids_and_batches(fake_server):
    tok = fake_server.tokenizer
    a, b = tok.encode("alpha beta"), tok.encode("gamma delta epsilon")
    r = gen(fake_server, input_ids=a, sampling_params={"max_new_tokens": 50})
    assert r["output_ids"] == a + [2]
    rs = gen(fake_server, input_ids=[a, b], sampling_params={"max_new_tokens": 50})
    assert [x["output_ids"] for x in rs] == [a + [2], b + [2]]
    assert [x["index"] for x in rs] == [0, 1]
    rs = gen(fake_server, text=["alpha beta", "gamma delta epsilon"],
             sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}])
    assert [x["output_ids"] for x in rs] == [a[:1], b[:2]]
    rs = gen(fake_server, text="alpha beta", sampling_params={"max_new_tokens": 50, "n": 3})
    assert len(rs) == 3 and all(x["text"] == "alpha beta" for x in rs)
    assert len({x["meta_info"]["id"] for x in rs}) == 3


def test_stream_cumulative_sse(fake_server):
    text = "Streaming text arrives token by token"
    n = len(fake_server.tokenizer.encode(text))
    events = gen(fake_server, text=text, stream=True, sampling_params={"max_new_tokens": 100})
    assert len(events) == n + 1  # one per token, EOS included
    texts = [e["text"] for e in events]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert texts[-1] == text
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert events[-1]["output_ids"][-1] == 2


def test_multibyte_text_is_never_split(fake_server):
    text = "héllo 日本語 ok ✓ 🙂 done"
    r = gen(fake_server, text=text, sampling_params={"max_new_tokens": 100})
    assert r["text"] == text
    events = gen(fake_server, text=text, stream=True, sampling_params={"max_new_tokens": 100})
    assert all("\ufffd" not in e["text"] for e in events)
    assert events[-1]["text"] == text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens(fake_server, stream):
    tok = fake_server.tokenizer
    text = "Hello world, this is a test"
    ids = tok.encode(text)
    assert tok.decode(ids[:1]) == "Hello"  # "lo wor" spans the first two tokens
    body = {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": 100,
                                                                "stop": ["zzz", "lo wor"]}}
    r = gen(fake_server, **body)
    last = r[-1] if stream else r
    assert last["text"] == "Hel"
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": "lo wor"}
    assert last["output_ids"] == ids[:2]  # stopped at the token completing the match
    if stream:  # text that is trimmed later is never sent
        assert all(e["text"] in ("", "Hel") for e in r)
    body["sampling_params"]["no_stop_trim"] = True
    r = gen(fake_server, **body)
    assert (r[-1] if stream else r)["text"] == "Hello wor"


def test_stop_string_single_and_stop_token_ids(fake_server):
    tok = fake_server.tokenizer
    text = "red green blue yellow"
    ids = tok.encode(text)
    r = gen(fake_server, text=text, sampling_params={"max_new_tokens": 100, "stop": " blue"})
    assert r["text"] == "red green"
    r = gen(fake_server, text=text, sampling_params={"max_new_tokens": 100,
                                                     "stop_token_ids": [ids[2]]})
    assert r["output_ids"] == ids[:3]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert r["text"] == tok.decode(ids[:2])  # the stop token's text is trimmed
    r = gen(fake_server, text=text, sampling_params={"max_new_tokens": 100, "no_stop_trim": True,
                                                     "stop_token_ids": [ids[2]]})
    assert r["text"] == tok.decode(ids[:3])


def test_ignore_eos_repeats(fake_server):
    ids = fake_server.tokenizer.encode("ab cd")
    r = gen(fake_server, input_ids=ids, sampling_params={"max_new_tokens": 7, "ignore_eos": True})
    assert r["output_ids"] == (ids * 7)[:7]
    assert r["meta_info"]["finish_reason"]["type"] == "length"


def test_logprobs_native(fake_server):
    tok = fake_server.tokenizer
    ids = tok.encode("log probs please")
    r = gen(fake_server, input_ids=ids, return_logprob=True, logprob_start_len=0,
            top_logprobs_num=2, sampling_params={"max_new_tokens": 2})
    m = r["meta_info"]
    assert [e[1] for e in m["input_token_logprobs"]] == ids
    assert m["input_token_logprobs"][0][0] is None and m["input_token_logprobs"][0][2] is None
    assert [e[1] for e in m["output_token_logprobs"]] == ids[:2]
    assert m["output_token_logprobs"][1][0] == pytest.approx(-0.1)
    assert len(m["output_top_logprobs"]) == 2 and len(m["output_top_logprobs"][0]) == 2
    assert len(m["input_top_logprobs"]) == len(ids)
    r = gen(fake_server, input_ids=ids, return_logprob=True, return_text_in_logprobs=True,
            sampling_params={"max_new_tokens": 1})
    m = r["meta_info"]
    assert m["input_token_logprobs"] == []  # key present as a list even with no prompt part
    assert m["output_token_logprobs"][0][2] == tok.decode(ids[:1])
    assert "output_top_logprobs" not in m


def test_router_default_fields_and_bootstrap(fake_server):
    """The body sglang-router sends: null model, extra defaults, bootstrap fields."""
    ids = fake_server.tokenizer.encode("routed request")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "model": None, "return_text_in_logprobs": False, "stream": False,
            "log_metrics": True, "return_hidden_states": False, "background": False,
            "no_logs": False, "return_bytes": False, "return_entropy": False,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": None,
            "bootstrap_room": 5372346660857392350, "rid": "my-rid-1", "routed_dp_rank": 0}
    r = gen(fake_server, **body)
    assert r["output_ids"] == (ids + [2])[:4] and r["meta_info"]["id"] == "my-rid-1"
    seen = fake_server.last_requests()[-1]
    assert seen["rid"] == "my-rid-1"
    route = seen["route"]  # the engine's one PD field (PDRoute), read by the role only
    assert (route["host"], route["port"], route["room"]) == \
        ("127.0.0.1", 8998, 5372346660857392350)  # null port -> the server's bootstrap port
    # batch: one entry per item (mini-lb style)
    body.update(input_ids=[ids, ids], bootstrap_host=["h1", "h2"], bootstrap_port=[1, 2],
                bootstrap_room=[11, 12], rid=None)
    gen(fake_server, **body)
    got = sorted((r["route"]["host"], r["route"]["port"], r["route"]["room"])
                 for r in fake_server.last_requests()[-2:])
    assert got == [("h1", 1, 11), ("h2", 2, 12)]


def test_sampling_params_reach_scheduler(fake_server):
    gen(fake_server, text="x y", sampling_params={
        "max_new_tokens": 2, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.1,
        "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.3,
        "sampling_seed": 42, "ignore_eos": True, "stop_token_ids": [7]})
    s = fake_server.last_requests()[-1]["sampling"]
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"]) == (0.7, 5, 0.9, 0.1)
    assert (s["repetition_penalty"], s["frequency_penalty"], s["presence_penalty"]) == \
        (1.1, 0.2, 0.3)
    assert s["seed"] == 42 and s["ignore_eos"] and s["stop_token_ids"] == [7]
    assert s["max_new_tokens"] == 2


def test_max_new_tokens_clamped_to_context(fake_server):
    """Policy: prompt + max_new_tokens beyond the context is clamped, finish_reason length."""
    ids = fake_server.tokenizer.encode("a b") * 100  # 200 tokens; context is 256
    ids = ids[:200]
    r = gen(fake_server, input_ids=ids, sampling_params={"max_new_tokens": 500,
                                                         "ignore_eos": True})
    assert r["meta_info"]["completion_tokens"] == 56
    assert r["meta_info"]["finish_reason"]["type"] == "length"
    r = gen(fake_server, input_ids=ids, sampling_params={"ignore_eos": True})
    assert r["meta_info"]["completion_tokens"] == 56  # default 128, clamped too


def test_zero_new_tokens_scores_the_prompt(fake_server):
    """max_new_tokens 0 (prompt scoring): no output, prompt logprobs still returned."""
    ids = fake_server.tokenizer.encode("score this prompt")
    r = gen(fake_server, input_ids=ids, return_logprob=True, logprob_start_len=0,
            sampling_params={"max_new_tokens": 0})
    assert r["output_ids"] == [] and r["text"] == ""
    m = r["meta_info"]
    assert m["completion_tokens"] == 0 and m["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in m["input_token_logprobs"]] == ids
    assert m["output_token_logprobs"] == []
