"""Tool calls in model output, as SGLang's `--tool-call-parser` names the formats.

A parser knows one model family's tool-call text: where a call starts (`start`), how to read
the calls out of a finished output (`parse`: the text around them stays content), and how a
forced call is written (`forced`: the prefix, the JSON the arguments go in and the suffix, from
which the engine builds the grammar for `tool_choice` "required" or a named function).

- `qwen25` (also `qwen`, `hermes`; Qwen 2.5 / Qwen 3, Hermes):
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call;
- `llama3`: `<|python_tag|>` optional, then `{"name": ..., "parameters": {...}}`, calls
  separated by `;`;
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- `deepseekv3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


MAX_PARSE_CHARS = 1 << 20  # a longer output is content: no tool calls are looked for in it
MAX_JSON_DEPTH = 64  # arguments nested deeper are no call (content)


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def _obj_calls(objs: list[Any], args_key: str, known: set[str]) -> list[ToolCall] | None:
    calls = []
    for o in objs:
        if not isinstance(o, dict) or o.get("name") not in known:
            return None
        args = o.get(args_key, o.get("arguments", o.get("parameters", {})))
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(o["name"], json.dumps(args, ensure_ascii=False)))
    return calls


_JSON_SYNTAX = re.compile(r'["\\\[\]{}]')  # one character: no backtracking


def json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep brackets nest in `text` outside JSON strings, counted up to `limit` + 1 (one
    linear pass over the brackets, quotes and backslashes only)."""
    depth = deepest = 0
    in_str, escaped_at = False, -2
    for m in _JSON_SYNTAX.finditer(text):
        ch, at = m.group(), m.start()
        if in_str:
            if escaped_at == at - 1:  # this character is escaped
                escaped_at = -2
            elif ch == "\\":
                escaped_at = at
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, back to back (whitespace and `;` between them); None when
    it holds anything else or nests deeper than MAX_JSON_DEPTH (json's own recursion would
    raise)."""
    if json_depth(text) > MAX_JSON_DEPTH:
        return None
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        out.append(value)


def _blocks(text: str, begin: str, end: str) -> list[tuple[int, int, int, int]]:
    """Each closed `begin`...`end` block of `text`, left to right, with str.find (linear): (where
    begin starts, where its inside starts, where end starts, where end stops). A block that never
    closes ends the list."""
    out, pos = [], 0
    while (lo := text.find(begin, pos)) >= 0:
        a = lo + len(begin)
        b = text.find(end, a)
        if b < 0:
            break
        pos = b + len(end)
        out.append((lo, a, b, pos))
    return out


class ToolParser:
    name = ""
    start = ""  # text that opens the tool-call part of an output
    args_key = "arguments"

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        """(content, calls); text that does not hold well-formed calls of known tools stays
        content, unchanged."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where a stream stops sending `text` as content: the start of a tool call, or of the
        end of `text` that may still become one (len(text): nothing held)."""
        i = text.find(self.start)
        return i if i >= 0 else len(text) - partial_tail(text, self.start)

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        """(prefix, JSON schema of what follows it, suffix) of one call to `name`."""
        return (self.start, {"type": "object", "properties": {
            "name": {"const": name}, self.args_key: schema},
            "required": ["name", self.args_key], "additionalProperties": False}, "")


class Qwen25(ToolParser):
    name, start = "qwen25", "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        if len(text) > MAX_PARSE_CHARS:
            return text, []
        blocks = _blocks(text, self.start, self.end)
        if not blocks:
            return text, []
        objs = [_json_values(text[a:b]) for _, a, b, _ in blocks]
        if any(o is None or len(o) != 1 for o in objs):
            return text, []
        calls = _obj_calls([o[0] for o in objs], "arguments", known)  # type: ignore[index]
        if calls is None:
            return text, []
        kept, pos = [], 0
        for lo, _, _, hi in blocks:
            kept.append(text[pos:lo])
            pos = hi
        kept.append(text[pos:])
        return "".join(kept).strip(), calls

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        _, obj, _ = super().forced(name, schema)
        return "<tool_call>\n", obj, "\n</tool_call>"


class Llama3(ToolParser):
    name, start, args_key = "llama3", "{", "parameters"

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        if len(text) > MAX_PARSE_CHARS:
            return text, []
        body = text.strip()
        head = ""
        if "<|python_tag|>" in body:
            head, body = body.split("<|python_tag|>", 1)
        elif not body.startswith("{"):
            return text, []
        objs = _json_values(body.strip())
        calls = _obj_calls(objs, "parameters", known) if objs else None
        return (head.strip(), calls) if calls else (text, [])


    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        _, obj, _ = super().forced(name, schema)
        return "", obj, ""  # the JSON object itself

    def hold_from(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{"):  # a JSON call may be coming: hold it all
            return 0
        i = text.find("<|python_tag|>")
        return i if i >= 0 else len(text) - partial_tail(text, "<|python_tag|>")


class Mistral(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        if self.start not in text or len(text) > MAX_PARSE_CHARS:
            return text, []
        head, body = text.split(self.start, 1)
        objs = _json_values(body.strip())
        if not objs or len(objs) != 1 or not isinstance(objs[0], list):
            return text, []
        calls = _obj_calls(objs[0], "arguments", known)
        return (head.strip(), calls) if calls else (text, [])

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        _, obj, _ = super().forced(name, schema)
        return "[TOOL_CALLS] [", obj, "]"


class DeepSeekV3(ToolParser):
    name = "deepseekv3"
    start = "<｜tool▁calls▁begin｜>"
    _begin, _sep, _end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    _open_args, _close_args = "\n```json\n", "\n```"

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        if self.start not in text or len(text) > MAX_PARSE_CHARS:
            return text, []
        head, body = text.split(self.start, 1)
        objs = []
        for _, a, b, _ in _blocks(body, self._begin, self._end):
            kind, sep, rest = body[a:b].partition(self._sep)
            name, opened, args = rest.partition(self._open_args)
            if kind != "function" or not sep or not opened or \
                    not args.endswith(self._close_args):
                continue  # what the old pattern did not match: not a call
            values = _json_values(args[:-len(self._close_args)])
            objs.append({"name": name.strip(), "arguments": values})
        if not objs or any(o["arguments"] is None or len(o["arguments"]) != 1 for o in objs):
            return text, []
        calls = _obj_calls([{**o, "arguments": o["arguments"][0]} for o in objs], "arguments",
                           known)
        return (head.strip(), calls) if calls else (text, [])

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        return (f"{self.start}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n", schema,
                "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


PARSERS: dict[str, type[ToolParser]] = {  # every --tool-call-parser name (fuzz suites list it)
    "qwen25": Qwen25, "qwen": Qwen25, "hermes": Qwen25, "llama3": Llama3, "mistral": Mistral,
    "deepseekv3": DeepSeekV3,
}
NAMES = tuple(PARSERS)  # --tool-call-parser's choices


def get_parser(name: str) -> ToolParser:
    return PARSERS[name]()
