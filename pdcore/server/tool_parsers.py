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


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, back to back (whitespace and `;` between them)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


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
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        blocks = list(self._block.finditer(text))
        if not blocks:
            return text, []
        objs = [_json_values(m.group(1)) for m in blocks]
        if any(o is None or len(o) != 1 for o in objs):
            return text, []
        calls = _obj_calls([o[0] for o in objs], "arguments", known)  # type: ignore[index]
        if calls is None:
            return text, []
        return self._block.sub("", text).strip(), calls

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        _, obj, _ = super().forced(name, schema)
        return "<tool_call>\n", obj, "\n</tool_call>"


class Llama3(ToolParser):
    name, start, args_key = "llama3", "{", "parameters"

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
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
        if self.start not in text:
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
    _call = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```"
                       r"<｜tool▁call▁end｜>", re.DOTALL)

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        head, body = text.split(self.start, 1)
        found = self._call.findall(body)
        objs = [{"name": n.strip(), "arguments": _json_values(a)} for n, a in found]
        if not objs or any(o["arguments"] is None or len(o["arguments"]) != 1 for o in objs):
            return text, []
        calls = _obj_calls([{**o, "arguments": o["arguments"][0]} for o in objs], "arguments",
                           known)
        return (head.strip(), calls) if calls else (text, [])

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        return (f"{self.start}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n", schema,
                "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


_PARSERS: dict[str, type[ToolParser]] = {
    "qwen25": Qwen25, "qwen": Qwen25, "hermes": Qwen25, "llama3": Llama3, "mistral": Mistral,
    "deepseekv3": DeepSeekV3,
}
NAMES = tuple(_PARSERS)  # --tool-call-parser's choices


def get_parser(name: str) -> ToolParser:
    return _PARSERS[name]()
