"""Tools and reasoning on /v1/chat/completions: the request side (`plan_tools`: checks `tools`
and `tool_choice`, and for "required" or a named function the grammar that forces a call) and
the answer side (`ChoiceShaper`: one choice's text split into reasoning, content and tool calls,
whole or as stream deltas).

`tool_choice`: "none" (tools reach the template, the output is content), "auto" (the default
with tools: calls found in the output by the server's `--tool-call-parser` are returned as
`tool_calls`), "required" (the output is forced to open with a call of one of the tools, its
arguments following that tool's JSON schema) or `{"type": "function", "function": {"name":
...}}` (forced, that tool). "auto" returns as many calls as the model writes, or only the first
with `parallel_tool_calls: false` (the later ones are dropped from `tool_calls`, not shown as
content). Forced calls need no `--tool-call-parser`: with a family parser whose calls hold JSON
the grammar writes that family's format (one call; constrained/, kind `tool_call`),
otherwise JSON (a list of `{"name", "parameters"}` for "required", at most one with
`parallel_tool_calls: false`; a named function's arguments alone), and the server reads back
what it forced.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdcore.messages.io import GrammarSpec
from pdcore.server.tools import tool_auto
from pdcore.server.params import bad
from pdcore.server.tools.reasoning import ReasoningParser
from pdcore.server.tools.tool_parsers import JsonCalls, NamedArgs, ToolParser, get_parser
from pdcore.server.tools.tool_stream import ToolStream, parse_whole

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 256 * 1024  # the tools' JSON, all together
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass
class ToolPlan:
    parser: ToolParser | None  # None: tool_choice "none" (no parsing)
    known: dict[str, dict[str, Any]]  # tool name -> its parameters' JSON schema
    grammar: GrammarSpec | None = None  # forcing a call ("required" or a named function)
    template_tools: list[dict[str, Any]] = field(default_factory=list)
    parallel: bool = True  # parallel_tool_calls: false returns the first call only

    @property
    def keep_special(self) -> bool:
        """The parser's markers are special tokens: the output must keep them."""
        return bool(self.parser is not None and self.parser.special and self.grammar is None)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    if len(json.dumps(tools)) > MAX_TOOLS_CHARS:
        raise bad(f"tools take more than {MAX_TOOLS_CHARS} characters of JSON", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or \
                not isinstance(f, dict):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                       f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must match [A-Za-z0-9_.-]{{1,64}}",
                       f"tools[{i}].function.name")
        if name in out:
            raise bad(f"tools[{i}]: a second tool named {name!r}", f"tools[{i}].function.name")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object",
                       f"tools[{i}].function.parameters")
        out[name] = params
    return out


def plan_tools(tools: Any, tool_choice: Any, parser_name: str | None,
               parallel: bool | None = None, template: str | None = None,
               model_type: str | None = None) -> ToolPlan | None:
    """None without tools; 400 for a malformed tool, an unknown named tool, or tool_choice
    "auto" on a server without a tool-call parser (its calls would come back as plain text).
    `--tool-call-parser auto` takes the parser from the chat `template` or the `model_type`.
    A forced call ("required" or a named function) needs no parser: the grammar writes it in
    the family's format where it has a JSON one, else as JSON (a list of `{"name",
    "parameters"}`, or a named function's arguments alone), and the server reads it back."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    schemas = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    forced: list[str] = []
    if choice == "required":
        forced = list(schemas)
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) \
            else None
        if name not in schemas:
            raise bad(f"tool_choice names {name!r}, which is not among the tools",
                       "tool_choice")
        forced = [name]
    elif choice not in ("auto", "none"):
        raise bad("tool_choice must be none, auto, required or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}", "tool_choice")
    if choice == "none":
        return ToolPlan(None, schemas, template_tools=list(tools))
    if parser_name == "auto":
        parser_name = tool_auto.resolve(template, model_type)
    parser = get_parser(parser_name) if parser_name else None
    keep = parallel is not False
    if not forced:
        if parser is None:
            raise bad("tools with tool_choice auto need a server started with "
                      "--tool-call-parser (auto or a model family's: qwen25, llama3, mistral, "
                      "...): without it calls would come back as plain text. tool_choice "
                      "\"required\" or a named function works without one", "tools")
        return ToolPlan(parser, schemas, None, list(tools), keep)
    alts = [parser.forced(n, schemas[n]) for n in forced] if parser else []
    if parser is not None and all(a is not None for a in alts):
        grammar = GrammarSpec("tool_call", json.dumps({"alternatives": alts}), "tool_choice")
        return ToolPlan(parser, schemas, grammar, list(tools), keep)
    if isinstance(choice, dict):  # the output is the named function's arguments
        return ToolPlan(NamedArgs(forced[0]), schemas, GrammarSpec(
            "json_schema", json.dumps(schemas[forced[0]]), "tool_choice"), list(tools), keep)
    one = [{"type": "object", "properties": {"name": {"const": n}, "parameters": schemas[n]},
            "required": ["name", "parameters"], "additionalProperties": False} for n in forced]
    listed = {"type": "array", "items": {"anyOf": one}, "minItems": 1}
    if not keep:
        listed["maxItems"] = 1
    return ToolPlan(JsonCalls(), schemas, GrammarSpec("json_schema", json.dumps(listed),
                                                      "tool_choice"), list(tools), keep)


def plan_output(body: Any, engine: Any) -> tuple[ToolPlan | None, ReasoningParser | None]:
    """A chat-shaped request's tools and reasoning on this server (the chat route's and
    /v1/responses'): `auto` resolved from the engine's chat template and model type; where a
    parser reads markers that are special tokens, the output keeps them unless the request
    says otherwise."""
    tools = plan_tools(body.tools, body.tool_choice, engine.args.tool_call_parser,
                       body.parallel_tool_calls, getattr(engine.tokenizer, "chat_template", None),
                       engine.info.model_type)
    name = engine.args.reasoning_parser
    reasoning = ReasoningParser(name) if name and body.separate_reasoning else None
    if body.skip_special_tokens is None and ((tools is not None and tools.keep_special) or
                                             (reasoning is not None and reasoning.style.special)):
        body.skip_special_tokens = False
    return tools, reasoning


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChoiceShaper:
    """One choice's output as OpenAI's message fields: reasoning_content (with a reasoning
    parser), content, tool_calls (with tools). Stream deltas add up to the whole; a stream
    sends each call's name once it is read and its arguments in pieces as they arrive."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolPlan | None) -> None:
        self.reasoning = reasoning.splitter() if reasoning is not None else None
        self.tools = tools if tools is not None and tools.parser is not None else None
        self.stream = ToolStream(self.tools.parser, self.tools.known, self.tools.parallel) \
            if self.tools is not None else None
        self.sent_r = self.sent_c = 0

    def _split(self, text: str, done: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, done)

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        r, c = self._split(text, True)
        msg: dict[str, Any] = {"role": "assistant", "content": c}
        if self.reasoning is not None:
            msg["reasoning_content"] = r or None
        if self.tools is not None:
            content, calls = parse_whole(self.tools.parser, c, self.tools.known,
                                         self.tools.parallel)
            if calls:  # content: the text before the first call (what a stream sends)
                msg["content"] = content or None
                msg["tool_calls"] = [{"id": _call_id(), "type": "function", "function": {
                    "name": k.name, "arguments": k.arguments}} for k in calls]
                reason = "tool_calls" if reason == "stop" else reason
        return msg, reason

    def delta(self, text: str, done: bool, reason: str | None) -> tuple[dict[str, Any],
                                                                          str | None]:
        """What the stream has not sent yet of `text` (the output so far). Each call reads
        only what arrived since the last one (linear over the stream)."""
        r0, r1, c0 = self.reasoning.spans(text, done) if self.reasoning is not None \
            else (0, 0, 0)
        out: dict[str, Any] = {}
        if r1 - r0 > self.sent_r:
            out["reasoning_content"], self.sent_r = text[r0 + self.sent_r:r1], r1 - r0
        if c0 is None:
            return out, reason
        end = len(text)
        if self.stream is not None:
            calls: list[dict[str, Any]] = []
            for k, name, piece in self.stream.feed(text, done, c0):
                if name is not None:
                    calls.append({"index": k, "id": _call_id(), "type": "function",
                                  "function": {"name": name, "arguments": ""}})
                elif calls and calls[-1]["index"] == k:
                    calls[-1]["function"]["arguments"] += piece
                else:
                    calls.append({"index": k, "function": {"arguments": piece}})
            end = self.stream.content_end(text, done)
            if calls:
                out["tool_calls"] = calls
            if done and self.stream.names:
                reason = "tool_calls" if reason == "stop" else reason
        if end - c0 > self.sent_c:
            out["content"], self.sent_c = text[c0 + self.sent_c:end], end - c0
        return out, reason
