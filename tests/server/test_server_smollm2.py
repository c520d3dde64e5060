"""The default model (SmolLM2-135M-Instruct GGUF, no --model-path) behind `pdserve serve`,
driven by the official openai client. Slow: loading the GGUF takes about a minute here."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from pdserve_testing import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_server(smollm2_gguf) -> Iterator[ServerProcess]:
    server = ServerProcess("--max-total-tokens", "8192", "--log-level", "warning")
    try:
        server.wait_healthy(timeout=600)
        yield server
    finally:
        server.stop()


def test_chat_answers_with_real_weights(smol_server):
    oa = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    model = oa.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in oa.chat.completions.create(
        model=model, messages=msgs, max_tokens=20, temperature=0, stream=True) if ch.choices)
    assert streamed == r.choices[0].message.content


def test_server_info_exports_a_tokenizer_folder(smol_server):
    """sglang-router loads `tokenizer_path`; for a GGUF we export the tokenizer files."""
    from transformers import AutoTokenizer

    info = httpx.get(smol_server.url + "/server_info", timeout=10).json()
    assert info["model_path"].endswith(".gguf")
    tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    assert tok.chat_template and tok.encode("Hello world") == [19556, 905]


def test_a_request_without_sampling_fields_takes_the_model_card_values(smol_server):
    """#45 item 5: the README's first curl names no temperature. The GGUF carries no generation
    config, so --sampling-defaults model (the default) takes SmolLM2's model card values
    (temperature 0.2, top_p 0.9), not temperature 1's gibberish: a seeded request without them
    equals one naming them."""
    info = httpx.get(smol_server.url + "/server_info", timeout=10).json()
    assert info["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    msgs = [{"role": "user", "content": "What is the capital of France?"}]

    def ask(**kw: object) -> str:
        r = httpx.post(smol_server.url + "/v1/chat/completions", timeout=120, json={
            "messages": msgs, "max_tokens": 24, "seed": 5, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert ask() == ask(temperature=0.2, top_p=0.9)
    assert ask() != ask(temperature=1.0, top_p=1.0)
