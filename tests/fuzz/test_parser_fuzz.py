"""Property-based fuzzing of every parser of client content and of model output (issue #44,
the fuzz-suite acceptance), in-process, no server:

- every registered tool-call parser (`tool_parsers.PARSERS`) and reasoning parser
  (`reasoning.PARSERS`), so a parser added later is fuzzed without touching this file: texts
  made of the parser's own markers, JSON syntax and whitespace, with one fragment repeated up
  to 64 Ki times (the worst cases a client can make a model write);
- grammar specs as the HTTP edge parses them (`json_schema` / `regex` / `ebnf` /
  `structural_tag` / `response_format`), JSON text bounded by `load_client_json`;
- the request schemas and `check_body`, the JSON-depth gate of every body, `tools`;
- chat encoding: no special token comes from a message's content.

Pass: each call returns or raises the client's error (InvalidRequestError / ValidationError),
nothing else, within hypothesis' deadline (the time budget of one example, generous: these
are linear and take milliseconds). Reproducible: derandomized, no example database.
PDSERVE_FUZZ_EXAMPLES scales the examples (default 25; each test runs a multiple of it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pdcore.edge.limits import SCHEMAS, check_body, json_too_deep
from pdcore.constrained.spec import (
    MAX_JSON_TEXT_DEPTH,
    load_client_json,
    spec_from_fields,
    spec_from_response_format,
)
from pdcore.errors import InvalidRequestError
from pdcore.messages.info import EngineInfo
from pdcore.server.tools import reasoning, tool_parsers
from pdcore.server.tools.chat_tools import ChoiceShaper, plan_tools

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES * 4, derandomize=True, database=None, deadline=2000,
                suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                print_blob=True)
REPEAT = 1 << 16  # a fragment repeated up to this many times

JSON_BITS = ['{', '}', '[', ']', '"', '\\', ':', ',', ' ', '\n', '\t', '"name"', '"arguments"',
             '"parameters"', '"f"', '{}', '1', 'null', 'true', '```json\n', '\n```', '\\"',
             '"\\u', ';', '<|python_tag|>', '<tool_call>', '</tool_call>', '[TOOL_CALLS]',
             '<think>', '</think>', 'x']


def _markers(parser: Any) -> list[str]:
    """Every string attribute of a parser class that looks like syntax (its markers)."""
    out = []
    for cls in type(parser).__mro__:
        for v in vars(cls).values():
            if isinstance(v, str) and v and v != parser.name:
                out.append(v)
    return out


def _texts(fragments: list[str]) -> st.SearchStrategy[str]:
    pieces = st.sampled_from(fragments) | st.text(max_size=4)
    mixed = st.lists(pieces, max_size=200).map("".join)
    repeated = st.tuples(st.lists(pieces, max_size=6).map("".join), pieces,
                         st.integers(1, REPEAT), st.lists(pieces, max_size=6).map("".join)
                         ).map(lambda t: t[0] + t[1] * t[2] + t[3])
    return mixed | repeated


@pytest.mark.parametrize("name", sorted(tool_parsers.PARSERS))
def test_tool_call_parsers(name: str) -> None:
    parser = tool_parsers.get_parser(name)
    known = {"f", "get_weather"}

    @FUZZ
    @given(text=_texts(JSON_BITS + _markers(parser)), cut=st.integers(0, 1 << 20))
    def run(text: str, cut: int) -> None:
        content, calls = parser.parse(text, known)
        assert isinstance(content, str)
        for call in calls:
            assert call.name in known
            assert isinstance(json.loads(call.arguments), dict)
        assert 0 <= parser.hold_from(text) <= len(text)
        # the chat route's view of it, whole and as a stream cut somewhere
        plan = plan_tools([{"type": "function", "function": {"name": "f"}}], "auto", name)
        shaper = ChoiceShaper(None, plan)
        shaper.delta(text[:cut % (len(text) + 1)], False, None)
        shaper.delta(text, True, "stop")
        shaper.message(text, "stop")

    run()


@pytest.mark.parametrize("name", sorted(reasoning.PARSERS))
def test_reasoning_parsers(name: str) -> None:
    parser = reasoning.PARSERS[name]()

    @FUZZ
    @given(text=_texts(JSON_BITS + [reasoning.OPEN, reasoning.CLOSE, "<", "</", "<th"]))
    def run(text: str) -> None:
        for done in (False, True):
            r, c = parser.split(text, done)
            assert isinstance(r, str) and isinstance(c, str)
            assert len(r) + len(c) <= len(text)

    run()


# ---- client content: grammar specs, JSON text, schemas, tools -----------------------------------
JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | \
    st.floats(allow_nan=False) | st.text(max_size=20)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.sampled_from(["type", "properties", "items", "required", "schema", "structures",
                     "triggers", "begin", "end", "format", "json_schema", "name", "a", "$ref",
                     "anyOf", "enum"]) | st.text(max_size=5), kids, max_size=4), max_leaves=30)


def _deep(opening: str, closing: str) -> st.SearchStrategy[str]:
    return st.integers(1, 40_000).map(lambda n: opening * n + closing * n)


JSON_TEXTS = (JSON_VALUES.map(json.dumps) | _deep("[", "]") | _deep('{"a":', "}")
              | _deep('{"type": "array", "items": ', "}") | _deep("[", "")
              | st.text(alphabet='[]{}":,\\ 0an', max_size=300))
CLIENT_ERRORS = (InvalidRequestError, ValidationError)


@FUZZ
@given(text=JSON_TEXTS)
def test_load_client_json(text: str) -> None:
    try:
        value = load_client_json(text, "f")
    except InvalidRequestError as e:
        assert e.field == "f"
        return
    stack, deepest = [(value, 1)], 0  # what it returns lies within the bound
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(c, depth + 1) for c in (node.values() if isinstance(node, dict) else node)]
    assert deepest <= MAX_JSON_TEXT_DEPTH


@FUZZ
@given(kind=st.sampled_from(["json_schema", "regex", "ebnf", "structural_tag"]),
       value=JSON_TEXTS | JSON_VALUES, rf_type=st.sampled_from(
           ["json_schema", "json_object", "structural_tag", "text", "x"]))
def test_grammar_specs(kind: str, value: Any, rf_type: str) -> None:
    try:
        spec = spec_from_fields({kind: value}, "sampling_params.")
        assert spec is None or spec.kind == kind
    except InvalidRequestError:
        pass
    rf: dict[str, Any] = {"type": rf_type, "json_schema": {"name": "x", "schema": value}}
    if rf_type == "structural_tag":
        rf = {"type": rf_type, "triggers": ["<a>"], "structures": [
            {"begin": "<a>", "schema": value, "end": "</a>"}]}
    try:
        spec_from_response_format(rf)
    except InvalidRequestError:
        pass


def _field_names() -> dict[str, list[str]]:
    return {route: sorted(model.model_fields) for route, model in SCHEMAS.items()}


HOSTILE = JSON_VALUES | st.sampled_from(
    [2**64, -(2**64), 1e308, "\ud800", "x" * 5000, [[[[[]]]]], {"type": "json"}]) | \
    st.lists(st.integers(-5, 2**40), max_size=8)


@FUZZ
@given(route=st.sampled_from(sorted(SCHEMAS)), data=st.data())
def test_request_schemas_and_bounds(route: str, data: st.DataObject) -> None:
    names = _field_names()[route]
    body = data.draw(st.dictionaries(st.sampled_from(names), HOSTILE, max_size=6))
    info = EngineInfo(vocab_size=49152, context_length=2048, dp_size=1)
    try:
        SCHEMAS[route].model_validate(body)
        check_body(route, body, info, 16)
    except CLIENT_ERRORS:
        pass


@FUZZ
@given(raw=st.binary(max_size=200) | _deep("[", "").map(str.encode)
       | _deep("{\"a\":", "}").map(str.encode) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_body_depth_gate(raw: bytes) -> None:
    why = json_too_deep(raw)
    assert why is None or "nested" in why


@FUZZ
@given(tools=HOSTILE | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "x"]),
     "function": st.fixed_dictionaries({"name": st.text(max_size=70) | st.just("f")},
                                       optional={"parameters": JSON_VALUES})}), max_size=4),
       choice=st.sampled_from([None, "auto", "none", "required", {"type": "function"},
                               {"type": "function", "function": {"name": "f"}}, 3]),
       parser=st.sampled_from(sorted(tool_parsers.PARSERS) + [None]))
def test_tools(tools: Any, choice: Any, parser: str | None) -> None:
    try:
        plan_tools(tools, choice, parser)
    except InvalidRequestError:
        pass


# ---- chat encoding: content is text -------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from types import SimpleNamespace

    from pdcore.engine.model.tokenizer import load_tokenizer

    return load_tokenizer(SimpleNamespace(model_path=str(tiny_llama_dir)))


def test_chat_content_never_becomes_special_tokens(tokenizer: Any) -> None:
    from pdcore.server.chat_encode import encode_chat

    specials = [t for t in tokenizer.all_special_tokens if t]
    special_ids = set(tokenizer.all_special_ids)

    def count(msgs: list[dict[str, Any]]) -> int:
        ids = encode_chat(tokenizer, msgs, add_generation_prompt=True,
                          continue_final_message=False, tools=None)
        return sum(t in special_ids for t in ids)

    @settings(FUZZ, max_examples=EXAMPLES * 2)
    @given(contents=st.lists(st.lists(st.sampled_from(specials + ["\n", "system", "user", "<",
                                                                  "|", ">", "x", " "]) |
                                      st.text(max_size=3), max_size=30).map("".join),
                             min_size=1, max_size=3),
           roles=st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=3,
                          max_size=3))
    def run(contents: list[str], roles: list[str]) -> None:
        msgs = [{"role": roles[i], "content": c} for i, c in enumerate(contents)]
        plain = [{**m, "content": "x"} for m in msgs]
        assert count(msgs) == count(plain)  # the template's own special tokens, no others

    run()
