"""1P1D (tcp) on SmolLM2 through our router and the real sglang-router: greedy output
token-identical to the unified engine; logprob merge; 200 concurrent requests. The data mover
does not matter to these checks, so a second SmolLM2 pair over shm (~27 s of CI) is not started:
shm's PD runs are test_pd_faults, test_pd_moe, test_pd_mla and test_pd_spec_tp (tiny models)
and the backend contract; SmolLM2 through the plugin backends is their BackendE2E."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import GREEDY, assert_same_tokens, generate, generate_all

from pdcore.testing.processes import PDCluster, ServerProcess, free_port

pytestmark = pytest.mark.heavy  # SmolLM2 P and D with 24576-token pools

FLAGS = ("--max-total-tokens", "24576", "--page-size", "16", "--chunked-prefill-size", "256")


@pytest.fixture(scope="module", params=["tcp"])
def cluster(request):
    c = PDCluster(request.param, flags=FLAGS).start()
    yield c
    c.stop()


def test_generate_token_identical(cluster, smollm2_unified):
    _, prompts, unified = smollm2_unified
    assert_same_tokens(generate_all(cluster.url, prompts), unified)
    assert_same_tokens(generate_all(cluster.url, prompts, stream=True), unified)
    cluster.wait_pages_free()


def test_chat_token_identical(cluster, smollm2_unified):
    from openai import OpenAI

    from pdcore.testing.prompts import CHAT_PROMPTS

    tok, _, unified = smollm2_unified
    client = OpenAI(base_url=cluster.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    for msgs, ref in zip(CHAT_PROMPTS, unified[4:]):
        want = tok.decode(ref["output_ids"], skip_special_tokens=True)
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=48,
                                           temperature=0)
        assert r.choices[0].message.content == want
        parts = client.chat.completions.create(model=model, messages=msgs, max_tokens=48,
                                               temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want


def test_parallel_samples_token_identical(cluster, smollm2_unified):
    """n > 1: every greedy sample (sample 0 from P's first token, the others forked on D from
    its prompt pages) equals the unified engine's output."""
    from pdcore.testing.prompts import CHAT_PROMPTS

    tok, prompts, unified = smollm2_unified
    body = {"input_ids": prompts[1], "sampling_params": {**GREEDY, "n": 3}}
    r = httpx.post(cluster.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [unified[1]["output_ids"]] * 3
    body = {"messages": CHAT_PROMPTS[0], "max_tokens": 48, "temperature": 0, "n": 2}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    want = tok.decode(unified[4]["output_ids"], skip_special_tokens=True)
    assert [c["message"]["content"] for c in r.json()["choices"]] == [want] * 2
    cluster.wait_pages_free()


def test_prompt_logprobs_merged(cluster, smollm2_unified):
    _, prompts, unified = smollm2_unified
    for i in (0, 2):
        out = generate(cluster.url, prompts[i], return_logprob=True, logprob_start_len=0)
        got, want = out["meta_info"]["input_token_logprobs"], unified[i]["input_logprobs"]
        assert len(got) == len(want) == len(prompts[i])
        for (gv, gt, *_), (wv, wt, _) in zip(got, want):
            assert gt == wt
            assert (gv is None and wv is None) or abs(gv - wv) < 1e-4
        outs = out["meta_info"]["output_token_logprobs"]
        for (gv, gt, *_), (wv, wt, _) in zip(outs, unified[i]["output_logprobs"]):
            assert gt == wt and abs(gv - wv) < 1e-4


def test_200_concurrent_requests(cluster):
    def one(k: int) -> dict:
        body = {"text": f"Request {k}: count to five.", "stream": False,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
        r = httpx.post(cluster.url + "/generate", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(200) as ex:
        outs = list(ex.map(one, range(200)))
    assert all(o["meta_info"]["completion_tokens"] == 8 for o in outs)
    cluster.wait_pages_free()


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router is not installed (pip install sglang-router)")
def test_real_sglang_router_token_identical(cluster, smollm2_unified):
    _, prompts, unified = smollm2_unified
    port = free_port()
    args = ["--pd-disaggregation", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--prefill", cluster.prefills[0].url,
            str(cluster.bootstrap_ports[0]), "--decode", cluster.decodes[0].url]
    router = ServerProcess(*args, port=port, command=("-m", "sglang_router.launch_router"))
    try:
        router.wait_healthy(120)
        url = router.url
        got = generate_all(url, prompts)
        assert_same_tokens(got, unified)
        body = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 48,
                "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        tok = smollm2_unified[0]
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(
            unified[4]["output_ids"], skip_special_tokens=True)
        lines = []
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=300) as resp:
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
        text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                       for ln in lines if json.loads(ln[6:]).get("choices"))
        assert text == tok.decode(unified[4]["output_ids"], skip_special_tokens=True)
        # n > 1: sglang-router sends one room per sample; the prompt's KV still crosses once
        r = httpx.post(url + "/v1/chat/completions", json={**body, "n": 3}, timeout=300)
        assert r.status_code == 200, r.text
        assert [c["message"]["content"] for c in r.json()["choices"]] == [tok.decode(
            unified[4]["output_ids"], skip_special_tokens=True)] * 3
        cluster.wait_pages_free()
    finally:
        router.stop()
