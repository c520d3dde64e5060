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


def test_json_object_is_an_object(servers, smollm2_tokenizer) -> None:
    """#45 item 8: response_format json_object forces an object (langchain's json_mode got
    `[1]` from the builtin JSON grammar); steered toward a list by logit_bias on '['."""
    bias = {str(t): 30 for t in smollm2_tokenizer.encode("[", add_special_tokens=False)}
    for name, url in _urls(servers).items():
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": 48, "response_format": {"type": "json_object"}, "logit_bias": bias})
        assert r.status_code == 200, (name, r.text)
        text = r.json()["choices"][0]["message"]["content"]
        assert text.lstrip().startswith("{"), (name, text)


# ---- /v1/responses (#45 item 7): the official client's responses.create, unified and 1P1D -----
R_TOOLS = [{"type": "function", "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "parameters": t["function"]["parameters"]} for t in TOOLS]


def _responses_urls(servers: dict[str, Any]) -> dict[str, str]:
    """Unified and pdserve's router over a tcp 1P1D."""
    return {k: servers[k] for k in ("unified", "pd-tcp")}


def test_responses_plain_and_streamed_equal_chat(servers) -> None:
    got = {}
    for name, url in _responses_urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        kw = {"model": _model(url), "instructions": "Be brief.", "temperature": 0,
              "max_output_tokens": 12}
        whole = client.responses.create(input="Say hello.", **kw)
        assert whole.object == "response" and whole.id.startswith("resp_"), (name, whole)
        assert whole.status == "incomplete", (name, whole)  # random model: runs to the cap
        assert whole.incomplete_details.reason == "max_output_tokens"
        assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
        [item] = whole.output
        assert item.type == "message" and item.role == "assistant"
        chat = client.chat.completions.create(
            model=_model(url), temperature=0, max_tokens=12,
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Say hello."}])
        assert whole.output_text == chat.choices[0].message.content, name
        # a message list as input is the same conversation
        listed = client.responses.create(input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Say hello."}]}], **kw)
        assert listed.output_text == whole.output_text, name
        events = list(client.responses.create(input="Say hello.", stream=True, **kw))
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"], kinds
        assert kinds[-1] == "response.incomplete", kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == whole.output_text == events[-1].response.output_text, name
        got[name] = whole.output_text
    assert len(set(got.values())) == 1, got


def test_responses_tool_call_plain_and_streamed(servers) -> None:
    got = {}
    for name, url in _responses_urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        kw = {"model": _model(url), "input": ASK[0]["content"], "tools": R_TOOLS,
              "tool_choice": "required", "temperature": 0, "max_output_tokens": 96}
        whole = client.responses.create(**kw)
        assert whole.status == "completed", (name, whole)
        calls = [o for o in whole.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].call_id.startswith("call_"), (name, whole.output)
        args = json.loads(calls[0].arguments)
        if calls[0].name == "get_weather":
            assert args["city"] in ("Paris", "Oslo", "Lima"), args
        events = list(client.responses.create(**kw, stream=True))
        added = [e.item for e in events if e.type == "response.output_item.added"]
        assert [i.type for i in added] == ["function_call"], (name, events)
        pieces = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert pieces == done[0].arguments == calls[0].arguments, name
        assert events[-1].type == "response.completed"
        # the call and its output go back as input items: the next turn renders and serves
        nxt = client.responses.create(model=_model(url), tools=R_TOOLS, temperature=0,
                                      max_output_tokens=6, input=[
            {"role": "user", "content": ASK[0]["content"]},
            {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": "sunny, 12 C"}])
        assert nxt.output[0].type == "message", (name, nxt.output)
        got[name] = (calls[0].name, args)
    assert len({json.dumps(v) for v in got.values()}) == 1, got


def test_responses_json_schema_output(servers) -> None:
    for name, url in _responses_urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
        kw = {"model": _model(url), "input": PROMPT, "text": {"format": fmt},
              "temperature": 0, "max_output_tokens": 96}
        whole = client.responses.create(**kw)
        assert whole.status == "completed", (name, whole)
        assert set(json.loads(whole.output_text)) == {"ok", "level", "n", "name"}, name
        streamed = client.responses.create(**kw, stream=True)
        final = [e for e in streamed if e.type == "response.completed"][0].response
        assert final.output_text == whole.output_text, name
        parsed = client.responses.parse(model=_model(url), input=PROMPT, text_format=Level,
                                        temperature=0, max_output_tokens=96)
        assert isinstance(parsed.output_parsed, Level), (name, parsed.output_text)


def test_responses_bad_input_says_what_to_fix(servers) -> None:
    url = servers["unified"]
    cases = [({"input": []}, "input"), ({"input": [{"role": "wizard", "content": "x"}]},
                                        "input[0].role"),
             ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
             ({"input": "x", "messages": []}, "messages"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                      "image_url": "x"}]}]},
              "input[0].content[0].type")]
    for body, param in cases:
        for target in (url, servers["pd-tcp"]):
            r = httpx.post(target + "/v1/responses", json=body, timeout=60)
            assert r.status_code == 400, (target, body, r.text)
            assert r.json()["error"]["param"] == param, (target, r.text)
    for c in servers["_clusters"]:
        c.wait_pages_free(30)


def test_responses_reasoning_item(servers) -> None:
    """--reasoning-parser qwen3: the think block is a reasoning output item before the message,
    whole and streamed (reasoning_text deltas); the output is steered by a regex."""
    rx = r"<think>[a-z]{3,8}( [a-z]{2,6}){0,2}</think>[A-Z][a-z]{2,6}"
    for name, url in _responses_urls(servers).items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        kw = {"model": _model(url), "input": ASK[0]["content"], "temperature": 0,
              "max_output_tokens": 64, "extra_body": {"regex": rx}}
        whole = client.responses.create(**kw)
        assert [o.type for o in whole.output] == ["reasoning", "message"], (name, whole.output)
        thought = whole.output[0].content[0].text
        assert re.fullmatch(r"[a-z]{3,8}( [a-z]{2,6}){0,2}", thought), (name, thought)
        assert re.fullmatch(r"[A-Z][a-z]{2,6}", whole.output_text), (name, whole.output_text)
        events = list(client.responses.create(**kw, stream=True))
        assert "".join(e.delta for e in events
                       if e.type == "response.reasoning_text.delta") == thought, name
        assert events[-1].response.output_text == whole.output_text, name
