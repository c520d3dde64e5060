"""Structured output through PD (#32 item 1): `/generate`'s regex, ebnf and json_schema, and
OpenAI's response_format (the openai client's `beta.chat.completions.parse` with pydantic
models), on a unified server, a tcp pair behind our router and a shm pair behind sglang-router.

The model is a tiny random Llama with SmolLM2's tokenizer: its preferences are noise, so every
valid output is the grammar's doing. P samples the first token under the grammar, D accepts it
into its own matcher and goes on: PD answers equal the unified ones token for token."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field, create_model

from pdcore.engine.model.tokenizer import default_model_file
from pdcore.testing.processes import PDCluster, ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

pytest.importorskip("xgrammar", reason="xgrammar is one of pdcore's dependencies")

FLAGS = ("--max-total-tokens", "4096", "--constrained-json-disable-any-whitespace",
         "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")
# a Qwen 2.5-style template that renders tools, calls and tool answers (SmolLM2's own has none)
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PROMPT = "Answer in the requested format."
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "name": {"type": "string", "maxLength": 6}},
    "required": ["ok", "level", "n", "name"], "additionalProperties": False}
GRAMMARS: dict[str, tuple[dict[str, Any], Any]] = {
    "regex": ({"regex": r"(red|green|blue)-[0-9]{2,4}"},
              lambda t: re.fullmatch(r"(red|green|blue)-[0-9]{2,4}", t)),
    "ebnf": ({"ebnf": 'root ::= "ans: " ("yes" | "no") " (" [0-9] ")"'},
             lambda t: re.fullmatch(r"ans: (yes|no) \([0-9]\)", t)),
    "json_schema": ({"json_schema": json.dumps(SCHEMA)},
                    lambda t: set(json.loads(t)) == {"ok", "level", "n", "name"}),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Any:
    folder = tmp_path_factory.mktemp("grammar")
    model = make_tiny_model(str(folder / "m"), seed=11, tokenizer_from=default_model_file())
    (folder / "tools.jinja").write_text(TEMPLATE)
    flags = (*FLAGS, "--chat-template", str(folder / "tools.jinja"))
    unified = ServerProcess("--model-path", model, *flags)
    tcp = PDCluster("tcp", model_path=model, flags=flags)
    shm = PDCluster("shm", model_path=model, flags=flags, router="sglang")
    try:
        unified.wait_healthy(180)
        tcp.start()
        shm.start()
        yield {"unified": unified.url, "pd-tcp": tcp.url, "pd-shm-sglang-router": shm.url,
               "_clusters": (tcp, shm)}
    finally:
        shm.stop()
        tcp.stop()
        unified.stop()


def _urls(servers: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in servers.items() if not k.startswith("_")}


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def _generate(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_generate_follows_the_grammar_and_pd_equals_unified(servers, kind: str) -> None:
    fields, valid = GRAMMARS[kind]
    got = {}
    for name, url in _urls(servers).items():
        r = _generate(url, {"text": PROMPT, "sampling_params": {
            "max_new_tokens": 64, "temperature": 0, **fields}})
        assert r.status_code == 200, (name, r.text)
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (name, out)
        assert valid(out["text"]), (name, out["text"])
        got[name] = out["output_ids"]
    assert len({json.dumps(v) for v in got.values()}) == 1, got


def test_sampled_samples_each_follow_the_grammar(servers) -> None:
    fields, valid = GRAMMARS["regex"]
    for name, url in _urls(servers).items():
        r = _generate(url, {"text": PROMPT, "sampling_params": {
            "max_new_tokens": 32, "temperature": 1.0, "n": 3, "seed": 7, **fields}})
        assert r.status_code == 200, (name, r.text)
        texts = [o["text"] for o in r.json()]
        assert all(valid(t) for t in texts), (name, texts)


class Level(BaseModel):
    ok: bool
    level: Literal["low", "mid", "high"]
    n: int = Field(ge=0, le=500)


class Tagged(BaseModel):
    name: str = Field(max_length=5)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


class Nested(BaseModel):
    inner: Level
    flag: bool | None


# field kinds whose every value is short: a random model cannot run on forever inside them
_KINDS: list[tuple[Any, Any]] = [
    (bool, ...), (Literal["x", "y", "z"], ...), (int, Field(ge=-9, le=9)),
    (str, Field(max_length=4)), (list[bool], Field(max_length=2)),
    (bool | None, None), (Literal[1, 2, 3], ...), (list[Literal["p", "q"]], Field(min_length=1,
                                                                               max_length=2)),
]


def _models() -> list[type[BaseModel]]:
    """20 schemas: the three above and 17 made from 2-4 fields of varied kinds, some nested."""
    made: list[type[BaseModel]] = [Level, Tagged, Nested]
    for k in range(17):
        fields = {f"f{j}": _KINDS[(k * 3 + j * 5) % len(_KINDS)]
                  for j in range(2 + k % 3)}
        if k % 4 == 3:
            fields["sub"] = (made[k % 3], ...)
        made.append(create_model(f"Schema{k}", **fields))  # type: ignore[call-overload]
    return made


MODELS = _models()


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
def test_openai_parse_returns_valid_objects(servers, model: type[BaseModel]) -> None:
    answers = {}
    for name, url in _urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        done = client.beta.chat.completions.parse(
            model=_model(url), messages=[{"role": "user", "content": PROMPT}],
            response_format=model, temperature=0, max_tokens=160)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", (name, choice)
        assert isinstance(choice.message.parsed, model), (name, choice.message.content)
        answers[name] = choice.message.content
    assert len(set(answers.values())) == 1, answers


def test_streamed_json_object_is_json(servers) -> None:
    for name, url in _urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        text = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=_model(url), messages=[{"role": "user", "content": PROMPT}], stream=True,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "s", "schema": SCHEMA, "strict": True}},
                temperature=0, max_tokens=96) if c.choices)
        assert set(json.loads(text)) == {"ok", "level", "n", "name"}, (name, text)


@pytest.mark.parametrize("body,status,words", [
    ({"regex": "(("}, 400, "regex cannot be compiled"),
    ({"json_schema": '{"type": "nonsense"}'}, 400, "json_schema cannot be compiled"),
    ({"json_schema": "{oops"}, 400, "not valid JSON"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, 400, "at most one of"),
])
def test_bad_grammar_is_400_and_holds_nothing(servers, body, status, words) -> None:
    for name, url in _urls(servers).items():
        r = _generate(url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, **body}})
        assert r.status_code == status, (name, r.text)
        assert words in r.text, (name, r.text)
    for c in servers["_clusters"]:
        c.wait_pages_free(30)
    ok = _generate(servers["pd-tcp"], {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, **GRAMMARS["regex"][0]}})
    assert ok.status_code == 200, ok.text


def test_grammar_fields_in_the_wrong_place_say_where(servers) -> None:
    url = servers["unified"]
    r = _generate(url, {"text": PROMPT, "regex": "a"})
    assert r.status_code == 400 and "sampling_params.regex" in r.text, r.text
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "regex": "a",
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "both constrain the output" in r.text, r.text


WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]


def _valid_call(call: Any) -> tuple[str, dict[str, Any]]:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7, args
    else:
        assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET"), call
    assert call.id.startswith("call_") and call.type == "function"
    return call.function.name, args


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_tool_call_streamed_and_not_pd_equals_unified(servers, choice) -> None:
    got = {}
    for name, url in _urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        kw = {"model": _model(url), "messages": ASK, "tools": TOOLS, "tool_choice": choice,
              "temperature": 0, "max_tokens": 96}
        done = client.chat.completions.create(**kw)
        ch = done.choices[0]
        assert ch.finish_reason == "tool_calls", (name, ch)
        calls = [_valid_call(c) for c in ch.message.tool_calls]
        assert len(calls) == 1 and ch.message.content is None, (name, ch.message)
        if isinstance(choice, dict):
            assert calls[0][0] == "get_time"
        streamed: dict[int, dict[str, str]] = {}
        reasons = []
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                for tc in c.delta.tool_calls or []:
                    d = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                    d["name"] += tc.function.name or ""
                    d["arguments"] += tc.function.arguments or ""
                assert not c.delta.content, (name, c.delta)
        assert reasons[-1] == "tool_calls"
        assert [(d["name"], json.loads(d["arguments"])) for d in streamed.values()] == calls
        got[name] = calls
    assert len({json.dumps(v) for v in got.values()}) == 1, got


def test_tool_results_go_back_to_the_model(servers) -> None:
    """A second turn with the assistant's call and the tool's answer renders and serves."""
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 C"}]
    for name, url in _urls(servers).items():
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": turn, "tools": TOOLS, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, (name, r.text)


def test_reasoning_content_is_separated(servers) -> None:
    """--reasoning-parser qwen3; the output is steered into a think block by a regex."""
    rx = r"<think>[a-z]{3,8}( [a-z]{2,6}){0,2}</think>[A-Z][a-z]{2,6}"
    for name, url in _urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        kw = {"model": _model(url), "messages": ASK, "temperature": 0, "max_tokens": 64,
              "extra_body": {"regex": rx}}
        msg = client.chat.completions.create(**kw).choices[0].message
        reasoning = msg.model_extra.get("reasoning_content")
        assert re.fullmatch(r"[a-z]{3,8}( [a-z]{2,6}){0,2}", reasoning or ""), (name, msg)
        assert re.fullmatch(r"[A-Z][a-z]{2,6}", msg.content), (name, msg)
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                parts["content"] += c.delta.content or ""
                parts["reasoning_content"] += (c.delta.model_extra or {}).get(
                    "reasoning_content") or ""
        assert parts == {"reasoning_content": reasoning, "content": msg.content}, (name, parts)
