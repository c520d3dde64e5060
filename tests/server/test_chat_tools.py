"""Tool calling and reasoning output (#32 item 2) without a server: every --tool-call-parser
reads the calls its model family writes; the grammar that forces a call (tool_choice required
or named) makes even random logits write a call that the parser reads back, with arguments
valid for the tool's schema; streamed deltas add up to the whole answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pdcore.constrained.backend import GrammarBackend
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.tokenizer import default_model_file, load_tokenizer
from pdcore.engine.sched.sampler import SampleState, sample
from pdcore.errors import InvalidRequestError
from pdcore.server.tools.chat_tools import ChoiceShaper, plan_tools
from pdcore.server.tools.reasoning import ReasoningParser
from pdcore.server.tools.tool_parsers import get_parser
from pdserve_testing import merge_calls

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
KNOWN = {"get_weather", "noop"}
ARGS = {"city": "Oslo", "days": 3, "metric": True}

WRITTEN = {
    "qwen25": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Oslo", "days": 3, "metric": true}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", '
              '"days": 3, "metric": true}}',
    "mistral": 'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": '
               '{"city": "Oslo", "days": 3, "metric": true}}]',
    "deepseekv3": "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                  'get_weather\n```json\n{"city": "Oslo", "days": 3, "metric": true}\n```'
                  "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}


@pytest.mark.parametrize("name", list(WRITTEN))
def test_parser_reads_its_format(name: str) -> None:
    content, calls = get_parser(name).parse(WRITTEN[name], KNOWN)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]
    assert content in ("Let me check.", "")


@pytest.mark.parametrize("name", list(WRITTEN))
def test_unknown_tool_or_broken_json_stays_content(name: str) -> None:
    p = get_parser(name)
    for text in (WRITTEN[name].replace("get_weather", "rm_rf"),
                 WRITTEN[name].replace('"days": 3', '"days": 3,,'), "plain answer"):
        assert p.parse(text, KNOWN) == (text, [])


def test_llama3_several_calls_and_qwen_several_blocks() -> None:
    two = '{"name": "noop", "parameters": {}}; {"name": "get_weather", "parameters": ' \
          '{"city": "Lima", "days": 1, "metric": false}}'
    assert [c.name for c in get_parser("llama3").parse(two, KNOWN)[1]] == ["noop", "get_weather"]
    q = ('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n'
         '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert len(get_parser("qwen25").parse(q, KNOWN)[1]) == 2


@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_returns_the_first_call(parallel) -> None:
    """parallel_tool_calls: false keeps the first call of an "auto" answer that holds two,
    whole and streamed; unset or true keeps both."""
    q = ('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 1, '
         '"metric": false}}\n</tool_call>')
    plan = plan_tools(TOOLS, "auto", "qwen25", parallel)
    want = ["noop"] if parallel is False else ["noop", "get_weather"]
    msg, reason = ChoiceShaper(None, plan).message(q, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == want and reason == "tool_calls"
    _, calls, _ = _stream(ChoiceShaper(None, plan), q)
    assert [c["function"]["name"] for c in calls] == want
    assert [c["index"] for c in calls] == list(range(len(want)))


@pytest.fixture(scope="module")
def backend():
    tok = load_tokenizer(SimpleNamespace(model_path=default_model_file()))
    return tok, GrammarBackend("xgrammar", lambda: tok, len(tok), [tok.eos_token_id],
                               any_whitespace=False)


@pytest.mark.parametrize("name", [*WRITTEN, None])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_call_from_random_logits_parses_back(backend, name: str | None, choice) -> None:
    """Every family with JSON arguments forces its own format; without a parser (#45 item 10)
    the grammar forces JSON the server reads (so it does for families whose arguments are not
    JSON: test_tool_parsers.test_forced_json_form_for_families_without_json_arguments)."""
    tok, gb = backend
    plan = plan_tools(TOOLS, choice, name, False)
    assert plan is not None and plan.grammar is not None
    for seed in range(2):
        st = SampleState.create(SamplingParams(temperature=1.0, seed=seed, grammar=plan.grammar),
                                [1])
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for _ in range(200):
            toks, _, errs = sample(torch.randn(1, len(tok), generator=g) * 4, [st], [None], gb)
            assert errs == [None], errs
            if toks[0] == tok.eos_token_id or st.grammar_done:
                break
            out.append(toks[0])
        text = tok.decode(out)
        msg, reason = ChoiceShaper(None, plan).message(text, "stop")
        calls = [SimpleNamespace(**c["function"]) for c in msg.get("tool_calls") or []]
        assert len(calls) == 1 and reason == "tool_calls", text
        if isinstance(choice, dict):
            assert calls[0].name == "get_weather"
        if calls[0].name == "get_weather":
            a = json.loads(calls[0].arguments)
            assert set(a) == {"city", "days", "metric"} and 1 <= a["days"] <= 7, a


@pytest.mark.parametrize("tools,choice,parser,words", [
    (TOOLS, "auto", None, "--tool-call-parser"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "qwen25", "not among the tools"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "qwen25", "must match"),
    ([{"type": "function", "function": {"name": "a"}}] * 2, "auto", "qwen25", "a second tool"),
    (TOOLS, "sometimes", "qwen25", "tool_choice must be"),
    (None, "required", "qwen25", "tool_choice needs tools"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], "auto", "qwen25",
     "JSON schema object"),
])
def test_bad_tools_are_400(tools, choice, parser, words) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        plan_tools(tools, choice, parser)


def test_tool_choice_none_parses_nothing() -> None:
    plan = plan_tools(TOOLS, "none", None)
    assert plan is not None and plan.parser is None and plan.grammar is None
    msg, reason = ChoiceShaper(None, plan).message(WRITTEN["qwen25"], "stop")
    assert msg["content"] == WRITTEN["qwen25"] and "tool_calls" not in msg and reason == "stop"


def _stream(shaper: ChoiceShaper, text: str, step: int = 3) -> tuple[dict[str, str], list, str]:
    got: dict[str, str] = {"content": "", "reasoning_content": ""}
    calls: list = []
    reason = None
    for end in [*range(step, len(text), step), len(text)]:
        done = end == len(text)
        d, reason = shaper.delta(text[:end], done, "stop" if done else None)
        for k in ("content", "reasoning_content"):
            got[k] += d.get(k, "")
        merge_calls(calls, d.get("tool_calls", []))
    return got, calls, reason


@pytest.mark.parametrize("name", list(WRITTEN))
def test_stream_deltas_add_up_to_the_message(name: str) -> None:
    plan = plan_tools(TOOLS, "auto", name)
    text = "<think>\nweather needs a tool\n</think>\n\n" + WRITTEN[name]
    whole, reason = ChoiceShaper(ReasoningParser("qwen3"), plan).message(text, "stop")
    got, calls, sreason = _stream(ChoiceShaper(ReasoningParser("qwen3"), plan), text)
    assert whole["reasoning_content"] == got["reasoning_content"] == "weather needs a tool\n"
    assert (whole["content"] or "") == got["content"]
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]
    assert reason == sreason == "tool_calls"
    assert "<tool_call>" not in got["content"] and "TOOL_CALLS" not in got["content"]


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("deepseek-r1", "thinking hard</think>The answer is 4.", "thinking hard", "The answer is 4."),
    ("deepseek-r1", "<think>\nstill thinking", "still thinking", ""),
    ("qwen3", "<think>\nhmm\n</think>\n\nYes.", "hmm\n", "Yes."),
    ("qwen3", "No thinking here.", "", "No thinking here."),
])
def test_reasoning_split_whole_and_streamed(parser, text, reasoning, content) -> None:
    msg, _ = ChoiceShaper(ReasoningParser(parser), None).message(text, "stop")
    assert (msg["reasoning_content"] or "") == reasoning and msg["content"] == content
    got, _, _ = _stream(ChoiceShaper(ReasoningParser(parser), None), text, step=2)
    assert got == {"content": content, "reasoning_content": reasoning}
