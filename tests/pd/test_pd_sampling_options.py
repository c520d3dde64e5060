"""`logit_bias` and `min_new_tokens` / `min_tokens` (#32 item 3), on a unified server and through
a PD pair (tcp) behind our router, on a tiny random Llama: each option changes the answer as
asked, the PD answer equals the unified one token for token (P samples the first token under the
same options, D the rest, counting P's token toward min_new_tokens), and bad values are 400."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pdcore.engine.model.tokenizer import default_model_file
from pdcore.testing.processes import PDCluster, ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

PROMPT = [5, 250, 61, 9, 3, 77, 12, 400, 31]
NEW = 6
FLAGS = ("--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Any:
    model = make_tiny_model(str(tmp_path_factory.mktemp("opts") / "m"), seed=5,
                            tokenizer_from=default_model_file())
    unified = ServerProcess("--model-path", model, *FLAGS)
    cluster = PDCluster("tcp", model_path=model, flags=FLAGS)
    try:
        unified.wait_healthy(180)
        cluster.start()
        yield {"unified": unified.url, "pd": cluster.url}
    finally:
        cluster.stop()
        unified.stop()


def _ids(url: str, **sp: Any) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                     **sp}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _both(servers: dict[str, str], **sp: Any) -> list[int]:
    got = {name: _ids(url, **sp) for name, url in servers.items()}
    assert got["pd"] == got["unified"], (sp, got)
    return got["unified"]


def test_logit_bias(servers) -> None:
    plain = _both(servers, ignore_eos=True)
    forced = _both(servers, ignore_eos=True, logit_bias={"777": 100})
    assert forced == [777] * NEW  # the first token too: sampled on P under the same bias
    banned = _both(servers, ignore_eos=True, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0] and plain[0] not in banned


def test_min_new_tokens(servers) -> None:
    plain = _both(servers, ignore_eos=True)
    stop = plain[1]  # greedy's second token, made a stop id
    assert _both(servers, stop_token_ids=[stop]) == plain[:2]
    held = _both(servers, stop_token_ids=[stop], min_new_tokens=4)
    assert len(held) >= 4 and stop not in held[:3], held  # not sampled before the 4th token
    # the OpenAI name, on the router
    r = httpx.post(servers["pd"] + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stop_token_ids": [stop],
        "min_tokens": 4, "logit_bias": {str(stop): 0}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 4


@pytest.mark.parametrize("body,field", [
    ({"sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
    ({"sampling_params": {"logit_bias": {"99999999": 1}}}, "sampling_params.logit_bias"),
    ({"sampling_params": {"logit_bias": {"5": 101}}}, "sampling_params.logit_bias"),
    ({"sampling_params": {"min_new_tokens": -1}}, "sampling_params.min_new_tokens"),
    ({"min_tokens": 3}, "min_tokens"),  # /generate takes it in sampling_params
])
def test_bad_values_are_400(servers, body, field) -> None:
    for url in servers.values():
        r = httpx.post(url + "/generate", json={"input_ids": PROMPT, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_in_pd_equal_unified(servers, max_tokens: int) -> None:
    """lm-eval's loglikelihood request: /v1/completions with echo, logprobs and (usually)
    max_tokens 0, a batch of prompts. In PD the prompt's logprobs come from P (our router puts
    them before D's), and the offsets continue after the echoed prompt (#32 item 3)."""
    body = {"prompt": [PROMPT, PROMPT[:5]], "max_tokens": max_tokens, "echo": True,
            "logprobs": 2, "temperature": 0}
    got = {}
    for name, url in servers.items():
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, (name, r.text)
        got[name] = r.json()["choices"]
    for u, p in zip(got["unified"], got["pd"]):
        lu, lp = u["logprobs"], p["logprobs"]
        assert len(lu["tokens"]) == len(PROMPT if u["index"] == 0 else PROMPT[:5]) + max_tokens
        assert (p["text"], lp["tokens"], lp["text_offset"]) == (
            u["text"], lu["tokens"], lu["text_offset"])
        assert lp["token_logprobs"][0] is None and lu["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(lu["token_logprobs"][1:], abs=1e-4)
        assert [sorted(t) for t in lp["top_logprobs"][1:]] == \
            [sorted(t) for t in lu["top_logprobs"][1:]]


def _streamed_choices(url: str, body: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A streamed /v1/completions answer put back together per choice: text and logprobs
    lists concatenated over the chunks, in order."""
    out: dict[int, dict[str, Any]] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for ch in json.loads(line[5:])["choices"]:
                acc = out.setdefault(ch["index"], {"text": "", "logprobs": {
                    "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}})
                acc["text"] += ch["text"]
                for k, v in (ch.get("logprobs") or {}).items():
                    acc["logprobs"][k] += v
    return out


def test_streamed_echo_logprobs_equal_the_whole_answer(servers) -> None:
    """The same request streamed: the echo chunk carries the prompt's entries (in PD, P's, put
    there by our router), and the offsets run on across chunks: the stream put together equals
    the unified JSON answer, unified and PD alike (#32 item 3)."""
    body = {"prompt": [PROMPT, PROMPT[:5]], "max_tokens": 3, "echo": True, "logprobs": 2,
            "temperature": 0}
    r = httpx.post(servers["unified"] + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    want = {c["index"]: c for c in r.json()["choices"]}
    for name, url in servers.items():
        got = _streamed_choices(url, body)
        assert sorted(got) == sorted(want), name
        for i, w in want.items():
            g, lw, lg = got[i], w["logprobs"], got[i]["logprobs"]
            assert g["text"] == w["text"], name
            assert (lg["tokens"], lg["text_offset"]) == (lw["tokens"], lw["text_offset"]), name
            assert lg["token_logprobs"][0] is None
            assert lg["token_logprobs"][1:] == pytest.approx(lw["token_logprobs"][1:], abs=1e-4)
