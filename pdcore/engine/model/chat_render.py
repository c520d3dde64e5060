"""Chat templates rendered with jinja2 alone, as transformers renders them (#48): the thin
tokenizer (thin_tokenizer.py) uses this so the HTTP process never imports transformers.

What transformers' `apply_chat_template` does, and so what this does (tests/engine/
test_thin_tokenizer.py compares the two): a sandboxed jinja2 environment (ImmutableSandbox,
trim_blocks, lstrip_blocks, loop controls, a `{% generation %}` block tag that renders its body),
`tojson` as json.dumps (no HTML escaping, ensure_ascii False), `raise_exception`,
`strftime_now`, a `dict` constructor and a `namespace` that refuses underscore names; messages
with their None-valued keys dropped, the template's data rebuilt from plain JSON types,
reasoning under its three names, the named special tokens as variables, and
`continue_final_message` cut where the final message ends.

`sanitize_control_tokens`: the control tokens (special added tokens, plus either the
tokenizer's `chat_control_tokens` or the added tokens the template's own text spells) found in
the client's strings are wrapped in two private-use markers before rendering; the rendered text
is then split at the markers and each marked token encoded as plain text (chat_encode.py
explains why)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

MARK_START, MARK_END = "\U000f0000", "\U000f0001"  # private use plane 15: wrap a client's token
_REASONING = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask templates): the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() without underscore attributes (no route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for k in attrs:
            _Namespace._check(k)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set the underscore attribute {name!r} on a namespace")


class _DictMaker:
    """`dict(...)` / `dict.fromkeys(...)` in a template, nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, dict=_DictMaker(), namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


@lru_cache(maxsize=16)
def literal_text(template: str) -> str:
    """The template's raw text and string constants, NUL-joined (no match across two)."""
    ast = compiled(template).environment.parse(template)
    parts = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    parts |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(parts)


@lru_cache(maxsize=16)
def token_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """Any of `tokens`, longest first (a token wins over the tokens inside it)."""
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)")


@lru_cache(maxsize=16)
def marked_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """A marked token (captured) or a lone marker (captures None)."""
    return re.compile(f"{MARK_START}({token_pattern(tokens).pattern}){MARK_END}"
                      f"|[{MARK_START}{MARK_END}]")


def mark(obj: Any, pattern: re.Pattern) -> Any:
    """`obj` with every control token in its strings wrapped in the markers (dict keys are
    not); markers already there are dropped first, so a client cannot forge one."""
    if isinstance(obj, str):
        obj = obj.replace(MARK_START, "").replace(MARK_END, "")
        return pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, obj)
    if isinstance(obj, dict):
        return {k: mark(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mark(v, pattern) for v in obj]
    return obj


def plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types; anything else becomes "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray" and \
            callable(getattr(value, "item", None)):  # a numpy scalar, without importing numpy
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _as_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def normalize(conversation: Any) -> list[dict]:
    """Messages as dicts, the keys whose value is None dropped."""
    out = []
    for m in _as_dicts(getattr(conversation, "messages", conversation)):
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, got {m!r}.")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for m in chat:
        r = next((m[k] for k in _REASONING if m.get(k) is not None), None)
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return out


def render(template: str, chat: list[dict], *, tools: Any, documents: Any,
           add_generation_prompt: bool, continue_final_message: bool | str,
           variables: dict[str, Any]) -> str:
    """One normalized conversation rendered (variables: the special tokens and the caller's
    template variables)."""
    tpl = compiled(template)
    if tools is not None:
        for t in tools:
            if not isinstance(t, dict):
                raise ValueError("Tools should be JSON schemas (dicts) here.")
    if documents is not None:
        for d in documents:
            if not isinstance(d, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools, documents, variables = plain(tools), plain(documents), plain(variables)
    chat = plain(chat)
    for m in chat:
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, got {m!r}.")
    chat = _alias_reasoning(chat)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        if (final := chat[-1].get(field)) is None:
            raise ValueError(f'continue_final_message is set but the final message has no '
                             f'"{field}" to continue!')
        fields = [field]
        if field in _REASONING:
            fields = [f for f in _REASONING if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an '
                             'accepted field in the chat_template')
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text "
                                 "to continue in the final message!")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = tpl.render(messages=chat, tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, **variables)
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the final message does not "
                             "appear in the chat after applying the chat template")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else \
            text[:at].rstrip()
    return text
