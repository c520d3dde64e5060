"""Chat template variables and the model's sampling defaults on a real server (#45 items 5, 7).

One `pdserve serve` on a tiny random Qwen3 (SmolLM2's tokenizer) whose own chat template is
Qwen3-style: `enable_thinking` false closes an empty think block after the generation prompt,
and a `reasoning_effort` it is given goes into a system line. Its generation_config.json names
top_k 1, so with `--sampling-defaults model` (the default) a request naming no sampling field
decodes greedily; a request's own values still win."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdcore.engine.model.tokenizer import default_model_file
from pdcore.testing.processes import ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

# written for this test in the shape of Qwen3's: the thinking switch after the generation prompt
TEMPLATE = """{%- if reasoning_effort is defined %}<|im_start|>system
Reasoning: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
CHAT = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(make_tiny_model(str(tmp_path_factory.mktemp("qwen3") / "m"), arch="qwen3",
                                seed=3, tokenizer_from=default_model_file()))
    cfg = path / "tokenizer_config.json"
    tok_cfg = json.loads(cfg.read_text())
    tok_cfg.pop("chat_template", None)
    cfg.write_text(json.dumps(tok_cfg))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1,
                                                             "temperature": 0.7}))
    return path


@pytest.fixture(scope="module")
def server(qwen3: Path) -> Iterator[ServerProcess]:
    s = ServerProcess("--model-path", str(qwen3), "--max-total-tokens", "4096")
    try:
        yield s.wait_healthy(180)
    finally:
        s.stop()


def _chat(server: ServerProcess, **extra: object) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": CHAT, "max_tokens": 12, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _rendered(qwen3: Path, **variables: object) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3))
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **variables)
    return len(tok.encode(text, add_special_tokens=False))


def test_enable_thinking_false_changes_the_rendered_prompt(server, qwen3) -> None:
    plain = _chat(server)["usage"]["prompt_tokens"]
    off = _chat(server, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert plain == _rendered(qwen3)
    assert off == _rendered(qwen3, enable_thinking=False) > plain  # the empty think block
    on = _chat(server, chat_template_kwargs={"enable_thinking": True})["usage"]["prompt_tokens"]
    assert on == plain


def test_reasoning_effort_reaches_a_template_that_reads_it(server, qwen3) -> None:
    plain = _chat(server)["usage"]["prompt_tokens"]
    low = _chat(server, reasoning_effort="low")["usage"]["prompt_tokens"]
    assert low == _rendered(qwen3, reasoning_effort="low") > plain
    # chat_template_kwargs names it too; its value wins over the field
    both = _chat(server, reasoning_effort="low",
                 chat_template_kwargs={"reasoning_effort": "high"})["usage"]["prompt_tokens"]
    assert both == _rendered(qwen3, reasoning_effort="high")


def test_model_sampling_defaults_apply_when_the_request_names_none(server) -> None:
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["sampling_defaults"] == {"top_k": 1, "temperature": 0.7}
    greedy = _chat(server, temperature=0)["choices"][0]["message"]["content"]
    for _ in range(2):  # generation_config's top_k 1: greedy without asking
        assert _chat(server)["choices"][0]["message"]["content"] == greedy
    # the request's own top_k wins: at temperature 1.5 over a random model, samples differ
    texts = {_chat(server, top_k=-1, temperature=1.5, seed=s)["choices"][0]["message"]["content"]
             for s in range(4)}
    assert len(texts) > 1, texts
