"""#44 item 5: one request must not freeze the HTTP process through an output parser.

A client's own `regex` plus `logit_bias` makes a tiny random model write `<tool_call>` and 3,200
spaces in 51 tokens (SmolLM2's tokenizer has a 64-space token); with `--tool-call-parser qwen25`
the old parser's regex backtracked cubically on that text (1,600 spaces: 1.7 s) on the event
loop and `/health` stopped answering. Here `/health` must answer within 1 s (the issue's bound)
all the while, and the answer is the text as content.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from pdcore.testing.processes import ServerProcess

pytest.importorskip("xgrammar", reason="xgrammar is one of pdcore's dependencies")

SPACES64 = 40686  # SmolLM2's token of 64 spaces
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


# a Qwen 2.5-style template: `--tool-call-parser auto` reads qwen25 off it
TEMPLATE = """{%- if tools %}<|im_start|>system
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Any:
    template = tmp_path_factory.mktemp("template") / "qwen.jinja"
    template.write_text(TEMPLATE)
    s = ServerProcess("--model-path", str(tiny_llama_dir), "--max-total-tokens", "4096",
                      "--tool-call-parser", "auto", "--chat-template", str(template),
                      "--reasoning-parser", "qwen3")
    try:
        yield s.wait_healthy(180)
    finally:
        s.stop()


def _attack(url: str, open_tag: str, tokens: int, stream: bool) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "regex": open_tag + " +",
            "logit_bias": {str(SPACES64): 100}, "max_tokens": tokens, "temperature": 0,
            "stream": stream}
    out: dict[str, Any] = {"content": "", "calls": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        if not stream:
            data = json.loads(r.read())
            assert "choices" in data, data
            msg = data["choices"][0]["message"]
            out["content"], out["calls"] = msg["content"] or "", len(msg.get("tool_calls") or [])
            return out
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    out["content"] += c["delta"].get("content") or ""
                    out["calls"] += len(c["delta"].get("tool_calls") or [])
    return out


def _health_while(url: str, work: Any) -> tuple[Any, float]:
    """Run `work` in a thread; probe /health every 0.1 s until it is done (timeouts count as
    their full length): (work's result, the slowest probe in seconds)."""
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(work()), daemon=True)
    t.start()
    slowest = 0.0
    with httpx.Client(timeout=5) as c:
        while t.is_alive():
            start = time.monotonic()
            try:
                c.get(url + "/health")
            except httpx.TimeoutException:
                pass
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.1)
    t.join(120)
    assert result, "the request did not finish"
    return result[0], slowest


def test_spaces_after_an_open_tool_call_do_not_stall_health(server) -> None:
    stream = False  # streamed, the same parse runs at the end (test_tool_parsers: per delta)
    tokens = 55  # longer outputs: tests/server/test_tool_parsers.py parses megabytes
    got, slowest = _health_while(server.url, lambda: _attack(server.url, "<tool_call>", tokens,
                                                             stream))
    assert got["status"] == 200, got
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the output was parsed"
    # an unfinished call is no call: the text comes back as content (streamed: what was not held)
    assert got["calls"] == 0
    assert got["content"].startswith("<tool_call>")
    assert got["content"].count(" ") >= (tokens - 10) * 64


CALL = '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo", "days": [1, 2, 3]}}\n</tool_call>'


def test_auto_parser_streams_a_call_in_pieces(server) -> None:
    """`auto` took qwen25 from the template: a call the output holds (steered by a regex)
    streams as its name first, then its arguments in pieces, and equals the whole answer."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
    kw = {"model": client.models.list().data[0].id, "messages": [{"role": "user", "content": "hi"}],
          "tools": TOOLS, "max_tokens": 64, "temperature": 0,
          "extra_body": {"regex": re.escape(CALL)}}
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("f", {"city": "Oslo", "days": [1, 2, 3]})
    first, pieces, args, reasons = None, 0, "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            assert not c.delta.content
            for tc in c.delta.tool_calls or []:
                if first is None:
                    first = tc
                    assert tc.id and tc.function.name == "f" and not tc.function.arguments
                else:
                    assert tc.index == 0 and not tc.function.name
                    pieces += 1
                    args += tc.function.arguments
    assert first is not None and pieces > 3 and reasons[-1] == "tool_calls"
    assert args == call.function.arguments
