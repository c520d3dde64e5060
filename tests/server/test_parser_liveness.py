"""#44 item 5: one request must not freeze the HTTP process through an output parser.

A client's own `regex` plus `logit_bias` makes a tiny random model write `<tool_call>` and 3,200
spaces in 51 tokens (SmolLM2's tokenizer has a 64-space token); with `--tool-call-parser qwen25`
the old parser's regex backtracked cubically on that text (1,600 spaces: 1.7 s) on the event
loop and `/health` stopped answering. Here `/health` must answer within 1 s (the issue's bound)
all the while, whole and streamed, and the answer is the text as content.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from pdcore.testing.processes import ServerProcess

pytest.importorskip("xgrammar", reason="xgrammar is one of pdcore's dependencies")

SPACES64 = 40686  # SmolLM2's token of 64 spaces
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Any:
    s = ServerProcess("--model-path", str(tiny_llama_dir), "--max-total-tokens", "4096",
                      "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")
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


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_spaces_after_an_open_tool_call_do_not_stall_health(server, stream) -> None:
    tokens = 55  # longer outputs: tests/server/test_tool_parsers.py parses megabytes
    got, slowest = _health_while(server.url, lambda: _attack(server.url, "<tool_call>", tokens,
                                                             stream))
    assert got["status"] == 200, got
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the output was parsed"
    # an unfinished call is no call: the text comes back as content (streamed: what was not held)
    assert got["calls"] == 0
    assert got["content"].startswith("<tool_call>") and got["content"].count(" ") >= (tokens - 10) * 64
