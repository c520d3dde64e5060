"""Every output parser (tool calls, reasoning) in linear time with a size cap (#44 item 5): the
worst inputs a client can make a model write (an open marker and a megabyte of spaces, markers
repeated, brackets nested 100,000 deep) parse within a generous liveness bound, answer content
and never raise. Each family's documented format (#45 item 11) read whole and streamed split
at every character, the arguments arriving in pieces (#45 item 10); `auto` from the template."""

from __future__ import annotations

import json
import time

import pytest

from pdcore.errors import InvalidRequestError
from pdcore.server.tools import reasoning, tool_auto, tool_parsers
from pdcore.server.tools.chat_tools import ChoiceShaper, plan_tools
from pdcore.server.tools.reasoning import ReasoningParser
from pdserve_testing import merge_calls

MEGA = 1 << 20


def _worst(start: str) -> list[str]:
    return [start + " " * MEGA, start * (MEGA // max(len(start), 1)), start + "[" * 100_000,
            start + "{" * 100_000 + "}" * 100_000, start + '"\\' * (MEGA // 2),
            start + '{"name": "f", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}",
            (start + '{"name": "f", "arguments": {}}\n') * 20_000]


@pytest.mark.parametrize("name", sorted(tool_parsers.PARSERS))
def test_tool_parsers_are_linear_and_capped(name: str) -> None:
    p = tool_parsers.get_parser(name)
    for text in _worst(p.start) + _worst("<tool_call>"):
        t = time.monotonic()
        content, calls = p.parse(text, {"f"})
        p.hold_from(text)
        assert time.monotonic() - t < 1.0, (name, text[:40], len(text))
        assert isinstance(content, str) and isinstance(calls, list)


@pytest.mark.parametrize("name", sorted(reasoning.PARSERS))
def test_reasoning_parsers_are_linear(name: str) -> None:
    p = reasoning.PARSERS[name]()
    for text in _worst("<think>") + _worst("</think>"):
        t = time.monotonic()
        for done in (False, True):
            r, c = p.split(text, done)
            assert isinstance(r, str) and isinstance(c, str)
        assert time.monotonic() - t < 1.0, (name, text[:40], len(text))


# ---- each family's documented format, whole and streamed at every boundary (#45 item 11) ----
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]
TWO = [("get_weather", {"city": "Oslo", "days": 3}), ("noop", {})]
DS = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FORMATS = {  # parser: (output, content before the calls, calls)
    "qwen25": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Oslo", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": '
               '{}}\n</tool_call>', "Let me check.", TWO),
    "qwen3_coder": ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
                    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
                    "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>", "Sure.", TWO),
    "glm45": ("Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo"
              "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
              "<tool_call>noop\n</tool_call>", "Sure.", TWO),
    "llama3": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": '
               '3}}; {"name": "noop", "parameters": {}}', "", TWO),
    "pythonic": ('[get_weather(city="Oslo", days=3), noop()]', "", TWO),
    "mistral": ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", '
                '"days": 3}}, {"name": "noop", "arguments": {}}]', "Sure.", TWO),
    "deepseekv3": (f"Sure.{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n"
                   f'{{"city": "Oslo", "days": 3}}\n```{DS[3]}{DS[1]}function{DS[2]}noop\n'
                   f"```json\n{{}}\n```{DS[3]}<｜tool▁calls▁end｜>", "Sure.", TWO),
    "deepseekv31": (f'Sure.{DS[0]}{DS[1]}get_weather{DS[2]}{{"city": "Oslo", "days": 3}}'
                    f"{DS[3]}{DS[1]}noop{DS[2]}{{}}{DS[3]}<｜tool▁calls▁end｜>", "Sure.", TWO),
    "kimi_k2": ("Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Oslo", "days": 3}<|tool_call_end|>'
                "<|tool_call_begin|>functions.noop:1<|tool_call_argument_begin|>{}"
                "<|tool_call_end|><|tool_calls_section_end|>", "Sure.", TWO),
    "gpt-oss": ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>"
                'json<|message|>{"city": "Oslo", "days": 3}<|call|>', "", TWO[:1]),
}


def _calls(msg: dict) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg.get("tool_calls") or []]


def _streamed(name: str, text: str, cuts: list[int]) -> tuple[str, list, str, int]:
    """(content, calls, finish reason, argument pieces) of `text` streamed in pieces ending at
    `cuts`."""
    shaper = ChoiceShaper(None, plan_tools(TOOLS, "auto", name))
    content, calls, reason, pieces = "", [], None, 0
    for end in [*cuts, len(text)]:
        done = end == len(text)
        d, reason = shaper.delta(text[:end], done, "stop" if done else None)
        content += d.get("content", "")
        pieces += sum(1 for c in d.get("tool_calls", []) if c["function"]["arguments"])
        merge_calls(calls, d.get("tool_calls", []))
    return content, calls, reason, pieces


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_whole_and_split_at_every_boundary(name: str) -> None:
    text, content, want = FORMATS[name]
    msg, reason = ChoiceShaper(None, plan_tools(TOOLS, "auto", name)).message(text, "stop")
    assert _calls(msg) == want and reason == "tool_calls", msg
    assert (msg["content"] or "") == content
    for cut in range(len(text) + 1):  # two deltas, split at every character
        got = _streamed(name, text, [cut])
        assert (got[0], _calls({"tool_calls": got[1]}), got[2]) == (content, want,
                                                                    "tool_calls"), cut
    got = _streamed(name, text, list(range(1, len(text))))  # one character per delta
    assert (got[0], _calls({"tool_calls": got[1]})) == (content, want)
    if name != "pythonic":  # arguments arrive in pieces (pythonic's: each call whole)
        assert got[3] > len(want), got


@pytest.mark.parametrize("name", list(FORMATS))
def test_unknown_tool_truncated_or_broken_stays_content(name: str) -> None:
    text = FORMATS[name][0]
    for bad in (text.replace("get_weather", "rm_rf"), text.replace('"days": 3', '"days": 3,,')
                .replace("days=3", "days=3,,"), text[:text.index("days") + 2], "plain answer"):
        if bad == text:  # that change does not apply to this format
            continue
        msg, reason = ChoiceShaper(None, plan_tools(TOOLS, "auto", name)).message(bad, "stop")
        assert msg["content"] == bad and "tool_calls" not in msg and reason == "stop", bad


def test_parallel_false_streams_the_first_call_only() -> None:
    text = FORMATS["qwen25"][0]
    shaper = ChoiceShaper(None, plan_tools(TOOLS, "auto", "qwen25", False))
    calls: list = []
    for end in range(1, len(text) + 1):
        d, _ = shaper.delta(text[:end], end == len(text), None)
        merge_calls(calls, d.get("tool_calls", []))
    assert _calls({"tool_calls": calls}) == TWO[:1]


# ---- --tool-call-parser auto ---------------------------------------------------------------
@pytest.mark.parametrize("template,model_type,want", [
    ("{% for c in m.tool_calls %}<tool_call>\n{{ c | tojson }}</tool_call>{% endfor %}", None,
     "qwen25"),
    ("<tool_call>\n<function={{ name }}>\n<parameter=", "qwen3", "qwen3_coder"),
    ("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>", None, "glm45"),
    ("<|tool_calls_section_begin|>", None, "kimi_k2"),
    ("<｜tool▁calls▁begin｜>function<｜tool▁sep｜>{{ n }}\n```json\n", None, "deepseekv3"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ n }}<｜tool▁sep｜>", None, "deepseekv31"),
    ("<|start|>assistant<|channel|>commentary to=functions.{{ n }}", None, "gpt-oss"),
    ("[TOOL_CALLS] {{ calls | tojson }}", None, "mistral"),
    ("<|python_tag|>{{ call }}", None, "llama3"),
    ("{{ messages }}", "qwen2", "qwen25"),
    ("{{ messages }}", "llama", "llama3"),
    ("{{ messages }}", "unknown_family", None),
])
def test_auto_picks_the_parser_the_template_writes(template, model_type, want) -> None:
    assert tool_auto.resolve(template, model_type) == want
    if want is None:  # auto calls need a parser; a forced call does not
        with pytest.raises(InvalidRequestError, match="--tool-call-parser"):
            plan_tools(TOOLS, "auto", "auto", None, template, model_type)
        assert plan_tools(TOOLS, "required", "auto", None, template, model_type).grammar
    else:
        plan = plan_tools(TOOLS, "auto", "auto", None, template, model_type)
        assert plan is not None and plan.parser is not None
        assert type(plan.parser) is type(tool_parsers.get_parser(want))


# ---- reasoning parsers ---------------------------------------------------------------------
REASONING = {  # parser: [(output, reasoning, content)]
    "deepseek-r1": [("thinking hard</think>The answer is 4.", "thinking hard",
                     "The answer is 4."), ("<think>\nstill thinking", "still thinking", "")],
    "qwen3-thinking": [("a plan\n</think>\n\nDone.", "a plan\n", "Done.")],
    "qwen3": [("<think>\nhmm\n</think>\n\nYes.", "hmm\n", "Yes."),
              ("No thinking here.", "", "No thinking here.")],
    "glm45": [("<think>why</think>Because.", "why", "Because."), ("Plain.", "", "Plain.")],
    "deepseek-v3": [("<think>x</think>y", "x", "y"), ("y", "", "y")],
    "kimi": [("◁think▷weigh it◁/think▷Fine.", "weigh it", "Fine."), ("Fine.", "", "Fine.")],
    "gpt-oss": [("<|channel|>analysis<|message|>User wants 4.<|end|><|start|>assistant"
                 "<|channel|>final<|message|>It is 4.", "User wants 4.", "It is 4."),
                ("<|channel|>final<|message|>Hi.", "", "Hi.")],
}


@pytest.mark.parametrize("name", list(REASONING))
def test_reasoning_whole_and_split_at_every_boundary(name: str) -> None:
    assert set(REASONING) == set(reasoning.NAMES)
    for text, r, c in REASONING[name]:
        msg, _ = ChoiceShaper(ReasoningParser(name), None).message(text, "stop")
        assert ((msg["reasoning_content"] or ""), msg["content"]) == (r, c), text
        for cuts in [[k] for k in range(len(text) + 1)] + [list(range(1, len(text)))]:
            shaper = ChoiceShaper(ReasoningParser(name), None)
            got = {"reasoning_content": "", "content": ""}
            for end in [*cuts, len(text)]:
                d, _ = shaper.delta(text[:end], end == len(text), None)
                for k in got:
                    got[k] += d.get(k, "")
            assert got == {"reasoning_content": r, "content": c}, (text, cuts)


def test_gpt_oss_reasoning_then_tool_call() -> None:
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}')
    msg, reason = ChoiceShaper(ReasoningParser("gpt-oss"),
                               plan_tools(TOOLS, "auto", "gpt-oss")).message(text, "stop")
    assert msg["reasoning_content"] == "Need weather." and msg["content"] is None
    assert _calls(msg) == [("get_weather", {"city": "Oslo"})] and reason == "tool_calls"


@pytest.mark.parametrize("parser,think,given,want", [
    ("llama3", None, None, False), ("qwen25", None, None, None), ("deepseekv3", None, True, True),
    (None, "gpt-oss", None, False), (None, "qwen3", None, None)])
def test_markers_that_are_special_tokens_stay_in_the_output(parser, think, given, want) -> None:
    """A parser whose markers are special tokens (<|python_tag|>, DeepSeek's, harmony's) keeps
    them in the output unless the request set skip_special_tokens itself."""
    from types import SimpleNamespace

    from pdcore.messages.info import EngineInfo
    from pdcore.server.tools.chat_tools import plan_output

    engine = SimpleNamespace(args=SimpleNamespace(tool_call_parser=parser, reasoning_parser=think),
                             tokenizer=SimpleNamespace(chat_template=None), info=EngineInfo())
    body = SimpleNamespace(tools=TOOLS if parser else None, tool_choice=None,
                           parallel_tool_calls=None, separate_reasoning=True,
                           skip_special_tokens=given)
    plan_output(body, engine)
    assert body.skip_special_tokens is want


@pytest.mark.parametrize("name", ["glm45", "qwen3_coder", "pythonic"])
def test_forced_json_form_for_families_without_json_arguments(name: str) -> None:
    """Their calls cannot be forced in their own format: the JSON form, read back as such."""
    required = plan_tools(TOOLS, "required", name)
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, name)
    assert required.grammar.kind == named.grammar.kind == "json_schema"
    msg, reason = ChoiceShaper(None, required).message(
        '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}]', "stop")
    assert _calls(msg) == TWO[:1] and reason == "tool_calls"
    msg, reason = ChoiceShaper(None, named).message('{"city": "Oslo", "days": 3}', "stop")
    assert _calls(msg) == TWO[:1] and msg["content"] is None and reason == "tool_calls"
