"""Tool calls in model output, as SGLang's `--tool-call-parser` names the formats.

A parser knows one model family's tool-call text: where the calls start (`start`), how to read
them (`calls`, an incremental reader over server/tools/tool_scan.py's cursor: linear in the output,
resumed delta by delta, so a stream sends each call's name as soon as it is read and its
arguments in pieces as they arrive), and how a forced call is written (`forced`: the prefix, the
JSON the arguments go in and the suffix, from which the engine builds the grammar for
`tool_choice` "required" or a named function; None where arguments are not JSON text).

- `qwen25` (also `qwen`, `hermes`; Qwen 2.5 / Qwen 3, Hermes):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...
  </function>\\n</tool_call>`;
- `glm45` (also `glm`, `glm47`): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE
  </arg_value>...</tool_call>`;
- `llama3`: `<|python_tag|>` optional, then `{"name": ..., "parameters": {...}}`, calls
  separated by `;`;
- `pythonic` (Llama 3.2+/4): `[get_weather(city="Oslo", days=3), noop()]`, optionally inside
  `<|python_start|>...<|python_end|>`;
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or (tokenizer v11+)
  `[TOOL_CALLS]NAME[ARGS]{...}` per call;
- `deepseekv3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  {...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- `deepseekv31` (V3.1, V3.2-Exp): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>
  {...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- `kimi_k2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`;
- `gpt-oss` (harmony): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
  {...}<|call|>`;
- `auto`: the one the chat template writes (tool_auto.py).

KEY/VALUE formats (qwen3_coder, glm45) give arguments as JSON built from the pairs: a value is
a JSON string where the tool's schema says "string" (or the value is not JSON), else its JSON.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pdcore.server.tools import tool_scan as ts
from pdcore.server.tools.tool_scan import Cursor, GiveUp, Reader, Sink, partial_tail
from pdcore.server.tools.tool_stream import ToolCall, parse_whole

MAX_PARSE_CHARS = 1 << 20  # a longer output is content: no tool calls are looked for in it
MAX_JSON_DEPTH = ts.MAX_JSON_DEPTH


class ToolParser:
    name = ""
    start = ""  # text that opens the tool-call part of an output
    args_key = "arguments"  # what a forced call's JSON names its arguments
    special = False  # its markers are special tokens: the output must keep them

    def read(self, cur: Cursor, sink: Sink) -> Reader:
        """Find where the calls start, then read them."""
        i = yield from ts.wait_for(cur, self.start)
        if i < 0:
            return
        sink.head(i)
        cur.pos = i + len(self.start)
        yield from self.calls(cur, sink)

    def calls(self, cur: Cursor, sink: Sink) -> Reader:
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where a stream stops sending `text` as content: the start of a tool call, or of the
        end of `text` that may still become one (len(text): nothing held)."""
        i = text.find(self.start)
        return i if i >= 0 else len(text) - partial_tail(text, self.start)

    def hold(self, cur: Cursor, memo: dict[str, int]) -> int:
        """hold_from for a stream whose reader has not found the calls' start yet, reading only
        the end of cur.text (`memo`: the stream's own notes between deltas)."""
        return len(cur.text) - partial_tail(cur.text, self.start)

    def parse(self, text: str, known: Any) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished output; text that does not hold well-formed calls of
        known tools stays content, unchanged."""
        return parse_whole(self, text, known)

    def forced(self, name: str, schema: dict[str, Any]
               ) -> tuple[str, dict[str, Any], str] | None:
        """(prefix, JSON schema of what follows it, suffix) of one call to `name`."""
        return (self.start, {"type": "object", "properties": {
            "name": {"const": name}, self.args_key: schema},
            "required": ["name", self.args_key], "additionalProperties": False}, "")


def _json_calls(cur: Cursor, sink: Sink, sep: str, close: str) -> Reader:
    """Call objects separated by `sep` until `close` (or the end of the output)."""
    while True:
        if not (yield from ts.call_object(cur, sink, ("arguments", "parameters"))):
            return
        ch = yield from ts.skip_ws(cur, sep)
        if not ch or ch == close:
            return
        if ch != "{":
            raise GiveUp


class Qwen25(ToolParser):
    name, start, end = "qwen25", "<tool_call>", "</tool_call>"

    def calls(self, cur: Cursor, sink: Sink) -> Reader:
        while True:
            if not (yield from self.one(cur, sink)):
                return
            if not (yield from ts.expect(cur, self.end)):
                if cur.done and cur.pos >= len(cur.text):
                    return  # the output stopped right after the call
                raise GiveUp
            if not (yield from ts.expect(cur, self.start)):
                return

    def one(self, cur: Cursor, sink: Sink) -> Reader:
        return (yield from ts.call_object(cur, sink, ("arguments", "parameters")))

    def forced(self, name: str, schema: dict[str, Any]
               ) -> tuple[str, dict[str, Any], str] | None:
        obj = super().forced(name, schema)
        return ("<tool_call>\n", obj[1], "\n</tool_call>") if obj else None


class _Pairs:
    """Arguments written as key/value pairs, built into JSON text piece by piece."""

    def __init__(self, sink: Sink, name: str) -> None:
        self.sink, self.name, self.n = sink, name, 0

    def add(self, key: str, value: str) -> None:
        kind = self.sink.param_type(self.name, key)  # type: ignore[attr-defined]
        text = value.strip()
        if kind == "string" or not text or ts.json_depth(text) > MAX_JSON_DEPTH or \
                not ts.valid_json(text):
            text = json.dumps(value, ensure_ascii=False)
        self.sink.args(("{" if self.n == 0 else ", ") + json.dumps(key, ensure_ascii=False)
                       + ": " + text)
        self.n += 1

    def close(self) -> None:
        self.sink.args("}" if self.n else "{}")
        self.sink.end()


class Qwen3Coder(Qwen25):
    name = "qwen3_coder"

    def one(self, cur: Cursor, sink: Sink) -> Reader:
        if not (yield from ts.expect(cur, "<function=")):
            raise GiveUp
        name = yield from ts.text_until(cur, ">")
        sink.call(name.strip())
        pairs = _Pairs(sink, name.strip())
        while True:
            if (yield from ts.expect(cur, "</function>")):
                pairs.close()
                return True
            if not (yield from ts.expect(cur, "<parameter=")):
                raise GiveUp
            key = yield from ts.text_until(cur, ">")
            value = yield from ts.text_until(cur, "</parameter>", MAX_PARSE_CHARS)
            if value.startswith("\n"):
                value = value[1:]
            pairs.add(key.strip(), value[:-1] if value.endswith("\n") else value)

    def forced(self, name: str, schema: dict[str, Any]) -> None:
        return None  # not JSON: forced calls take the JSON form (tool_stream.JsonCalls)


class Glm45(Qwen25):
    name = "glm45"

    def one(self, cur: Cursor, sink: Sink) -> Reader:
        name, _ = yield from ts.until_any(cur, ("\n", "<arg_key>", self.end))
        sink.call(name.strip())
        pairs = _Pairs(sink, name.strip())
        while True:
            yield from ts.skip_ws(cur)
            while not cur.done and len(cur.text) - cur.pos < len(self.end) and \
                    self.end.startswith(cur.text[cur.pos:]):
                yield  # "</" may still be the end or a key: wait until it tells
            if cur.pos >= len(cur.text) or cur.text.startswith(self.end, cur.pos):
                pairs.close()
                return True
            if not (yield from ts.expect(cur, "<arg_key>")):
                raise GiveUp
            key = yield from ts.text_until(cur, "</arg_key>")
            if not (yield from ts.expect(cur, "<arg_value>")):
                raise GiveUp
            pairs.add(key.strip(), (yield from ts.text_until(cur, "</arg_value>",
                                                             MAX_PARSE_CHARS)))

    def forced(self, name: str, schema: dict[str, Any]) -> None:
        return None


class Llama3(ToolParser):
    name, start, args_key, special = "llama3", "{", "parameters", True
    tag = "<|python_tag|>"

    def read(self, cur: Cursor, sink: Sink) -> Reader:
        first = yield from ts.skip_ws(cur)
        if first != "{":
            i = yield from ts.wait_for(cur, self.tag, cur.base)
            if i < 0:
                return
            cur.pos = i + len(self.tag)
            yield from ts.skip_ws(cur)
            sink.head(i)
        else:
            sink.head(cur.pos)
        yield from _json_calls(cur, sink, ";", "")

    def forced(self, name: str, schema: dict[str, Any]
               ) -> tuple[str, dict[str, Any], str] | None:
        obj = super().forced(name, schema)
        return ("", obj[1], "") if obj else None  # the JSON object itself

    def hold_from(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{"):  # a JSON call may be coming: hold it all
            return 0
        i = text.find(self.tag)
        return i if i >= 0 else len(text) - partial_tail(text, self.tag)

    def hold(self, cur: Cursor, memo: dict[str, int]) -> int:
        if cur.pos >= len(cur.text):  # only whitespace yet: a JSON call may be coming
            return cur.base
        return len(cur.text) - partial_tail(cur.text, self.tag)


class Mistral(ToolParser):
    name, start, special = "mistral", "[TOOL_CALLS]", True

    def calls(self, cur: Cursor, sink: Sink) -> Reader:
        ch = yield from ts.skip_ws(cur)
        if ch == "[":
            cur.pos += 1
            yield from _json_calls(cur, sink, ",", "]")
            return
        while True:  # NAME[ARGS]{...} per call
            name = yield from ts.text_until(cur, "[ARGS]")
            sink.call(name.strip())
            if not (yield from ts.json_value(cur, sink.args, "{")):
                return
            sink.end()
            if not (yield from ts.expect(cur, self.start)):
                return

    def forced(self, name: str, schema: dict[str, Any]
               ) -> tuple[str, dict[str, Any], str] | None:
        obj = super().forced(name, schema)
        return ("[TOOL_CALLS] [", obj[1], "]") if obj else None


class DeepSeekV3(ToolParser):
    name, special = "deepseekv3", True
    start = "<｜tool▁calls▁begin｜>"
    begin, sep, end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

    def calls(self, cur: Cursor, sink: Sink) -> Reader:
        while (yield from ts.expect(cur, self.begin)):
            if not (yield from self.one(cur, sink)):
                return
            sink.end()
            if not (yield from ts.expect(cur, self.end)):
                return

    def one(self, cur: Cursor, sink: Sink) -> Reader:
        if (yield from ts.text_until(cur, self.sep)).strip() != "function":
            raise GiveUp
        sink.call((yield from ts.text_until(cur, "```json")).strip())
        if not (yield from ts.json_value(cur, sink.args, "{")):
            return False
        return (yield from ts.expect(cur, "```"))

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        return (f"{self.start}{self.begin}function{self.sep}{name}\n```json\n", schema,
                f"\n```{self.end}<｜tool▁calls▁end｜>")


class DeepSeekV31(DeepSeekV3):
    name = "deepseekv31"

    def one(self, cur: Cursor, sink: Sink) -> Reader:
        sink.call((yield from ts.text_until(cur, self.sep)).strip())
        return (yield from ts.json_value(cur, sink.args, "{"))

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        return (f"{self.start}{self.begin}{name}{self.sep}", schema,
                f"{self.end}<｜tool▁calls▁end｜>")


class KimiK2(DeepSeekV3):
    name = "kimi_k2"
    start, begin = "<|tool_calls_section_begin|>", "<|tool_call_begin|>"
    sep, end = "<|tool_call_argument_begin|>", "<|tool_call_end|>"

    def one(self, cur: Cursor, sink: Sink) -> Reader:
        ident = (yield from ts.text_until(cur, self.sep)).strip()  # functions.NAME:INDEX
        ident = ident.removeprefix("functions.")
        sink.call(ident.rsplit(":", 1)[0] if ":" in ident else ident)
        return (yield from ts.json_value(cur, sink.args, "{"))

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        return (f"{self.start}{self.begin}functions.{name}:0{self.sep}", schema,
                f"{self.end}<|tool_calls_section_end|>")


class GptOss(ToolParser):
    """Harmony: a call is a commentary message addressed `to=functions.NAME`; the header
    (`<|start|>assistant<|channel|>commentary`...) before it is not content."""
    name, start, special = "gpt-oss", " to=functions.", True
    header = ("<|start|>", "<|channel|>")

    def read(self, cur: Cursor, sink: Sink) -> Reader:
        first = True
        while True:
            i = yield from ts.wait_for(cur, "to=functions.")
            if i < 0:
                return
            if first:
                sink.head(self._header_start(cur.text, i, cur.base))
                first = False
            cur.pos = i + len("to=functions.")
            name, _ = yield from ts.until_any(cur, (" ", "<|"))
            sink.call(name.strip())
            if (yield from ts.wait_for(cur, "<|message|>")) < 0:
                raise GiveUp
            cur.pos = cur.text.find("<|message|>", cur.pos) + len("<|message|>")
            if not (yield from ts.json_value(cur, sink.args, "{")):
                return
            sink.end()

    def _header_start(self, text: str, i: int, base: int) -> int:
        return min([j for j in (text.rfind(h, base, i) for h in self.header) if j >= 0] or [i])

    def hold(self, cur: Cursor, memo: dict[str, int]) -> int:
        if "at" not in memo:
            scan = memo.get("scan", cur.base)
            found = [j for j in (cur.text.find(h, scan) for h in self.header) if j >= 0]
            if found:
                memo["at"] = min(found)
            else:
                memo["scan"] = max(cur.base, len(cur.text) - 16)
        if "at" in memo:
            return memo["at"]
        return len(cur.text) - max(partial_tail(cur.text, h) for h in self.header)

    def hold_from(self, text: str) -> int:
        i = min([j for j in (text.find(h) for h in self.header) if j >= 0] or [len(text)])
        return min(i, len(text) - max(partial_tail(text, h) for h in self.header))

    def forced(self, name: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        return (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
                schema, "<|call|>")


class Pythonic(ToolParser):
    """A Python list of calls with keyword arguments of literal values."""
    name, start = "pythonic", "["
    tag, close_tag = "<|python_start|>", "<|python_end|>"

    def read(self, cur: Cursor, sink: Sink) -> Reader:
        first = yield from ts.skip_ws(cur)
        if first == "<":
            at = cur.pos
            if not (yield from ts.expect(cur, self.tag, ws=False)):
                return
            sink.head(at)
            first = yield from ts.skip_ws(cur)
        if first != "[":
            return
        sink.head(cur.pos)
        end = yield from _python_list_end(cur)
        if end < 0:
            return
        for name, args in _python_calls(cur.text[cur.pos:end]):
            sink.call(name)
            sink.args(args)
            sink.end()
        cur.pos = end

    def hold_from(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("[") or self.tag.startswith(body[:len(self.tag)]):
            return 0
        return len(text)

    def hold(self, cur: Cursor, memo: dict[str, int]) -> int:
        return cur.base  # undecided: whitespace or the start of <|python_start|> so far

    def forced(self, name: str, schema: dict[str, Any]) -> None:
        return None


_PY_SYNTAX = re.compile(r"[\[\](){}'\"\\]")


def _python_list_end(cur: Cursor) -> Reader:
    """Where the Python list at cur.pos ends (just past its `]`); -1 when the output ends
    first. Brackets inside strings do not count; nesting past MAX_JSON_DEPTH gives up."""
    scan = ts.Brackets(cur.pos, syntax=_PY_SYNTAX, quotes="'\"", opens="([{", closes=")]}")
    while True:
        end = scan.feed(cur.text, to_close=True)
        if scan.too_deep:
            raise GiveUp
        if end >= 0:
            return end
        if cur.done:
            return -1
        yield


def _python_calls(src: str) -> list[tuple[str, str]]:
    """[(name, arguments as JSON text)] of `[f(a=1), g()]`; GiveUp for anything else."""
    try:
        tree = ast.parse(src, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise GiveUp
        out = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or \
                    not isinstance(node.func, (ast.Name, ast.Attribute)):
                raise GiveUp
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            if None in args:  # **kwargs
                raise GiveUp
            out.append((ast.unparse(node.func), json.dumps(args, ensure_ascii=False)))
        return out
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        raise GiveUp from None


class JsonCalls(ToolParser):
    """What a forced call is without a family parser (tool_choice "required"): a JSON array
    of `{"name": ..., "parameters": {...}}`, written by the grammar."""
    name, start = "json", "["

    def read(self, cur: Cursor, sink: Sink) -> Reader:
        if (yield from ts.skip_ws(cur)) != "[":
            raise GiveUp
        sink.head(cur.pos)
        cur.pos += 1
        yield from _json_calls(cur, sink, ",", "]")


class NamedArgs(ToolParser):
    """A forced call of one named tool without a family parser: the output is its arguments."""
    name, start = "json", "{"

    def __init__(self, tool: str) -> None:
        self.tool = tool

    def read(self, cur: Cursor, sink: Sink) -> Reader:
        yield from ts.skip_ws(cur)
        sink.head(cur.pos)
        sink.call(self.tool)
        if (yield from ts.json_value(cur, sink.args, "{")):
            sink.end()


PARSERS: dict[str, type[ToolParser]] = {  # every parser by its name (fuzz suites list it)
    "qwen25": Qwen25, "qwen3_coder": Qwen3Coder, "glm45": Glm45, "llama3": Llama3,
    "pythonic": Pythonic, "mistral": Mistral, "deepseekv3": DeepSeekV3,
    "deepseekv31": DeepSeekV31, "kimi_k2": KimiK2, "gpt-oss": GptOss,
}
ALIASES = {"qwen": "qwen25", "hermes": "qwen25", "glm": "glm45", "glm47": "glm45"}
NAMES = (*PARSERS, *ALIASES, "auto")  # --tool-call-parser's choices


def get_parser(name: str) -> ToolParser:
    return PARSERS[ALIASES.get(name, name)]()
