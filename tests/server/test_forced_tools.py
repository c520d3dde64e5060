"""Forced tool calls without `--tool-call-parser` (#45 item 10), as vLLM serves them: for
`tool_choice` "required" the grammar writes a JSON list of `{"name", "parameters"}`, for a named
function its arguments alone, and the server returns what it forced as `tool_calls`, whole and
streamed (the name first, then the arguments in pieces). "auto" still needs a parser (400)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from pdcore.testing.processes import ServerProcess

pytest.importorskip("xgrammar", reason="xgrammar is one of pdcore's dependencies")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client(tiny_llama_dir) -> Any:
    s = ServerProcess("--model-path", str(tiny_llama_dir), "--max-total-tokens", "4096",
                      "--constrained-json-disable-any-whitespace")
    try:
        s.wait_healthy(180)
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=120)
    finally:
        s.stop()


def _valid(name: str, args: dict[str, Any]) -> None:
    if name == "get_weather":
        assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7, args
    else:
        assert name == "get_time" and args["zone"] in ("UTC", "CET"), args


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_call_without_a_parser_whole_and_streamed(client, choice) -> None:
    kw = {"model": client.models.list().data[0].id, "tools": TOOLS, "tool_choice": choice,
          "messages": [{"role": "user", "content": "Weather in Oslo?"}], "temperature": 0,
          "max_tokens": 96, "parallel_tool_calls": False}
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
    assert len(calls) == 1 and all(c.id.startswith("call_") for c in ch.message.tool_calls)
    _valid(*calls[0])
    if isinstance(choice, dict):
        assert calls[0][0] == "get_time"
    name, args, pieces, reasons = "", "", 0, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            assert not c.delta.content, c.delta
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                name += tc.function.name or ""
                args += tc.function.arguments or ""
                pieces += bool(tc.function.arguments)
    assert reasons[-1] == "tool_calls" and (name, json.loads(args)) == calls[0]
    assert pieces > 1, "the arguments came in one piece"


def test_auto_without_a_parser_is_400(client) -> None:
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        client.chat.completions.create(model=client.models.list().data[0].id, tools=TOOLS,
                                       messages=[{"role": "user", "content": "hi"}])
