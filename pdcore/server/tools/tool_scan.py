"""Incremental, linear-time reading of model output for the tool-call parsers.

A `Cursor` holds an output that only grows (each stream delta extends it) and a position that
only moves forward. A format's reader is a generator over the cursor: when it needs text that
has not arrived it yields, and the next delta resumes it where it stopped, so every character
is looked at a bounded number of times whatever the deltas are (no regex backtracking, no
re-reading the output per delta). `GiveUp` means the text is not a call in that format: it is
content.

JSON is scanned for its extent only (quotes, escapes and brackets, one regex of single
characters, so no backtracking); nesting deeper than MAX_JSON_DEPTH gives up, so json's own
recursion never runs out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator
from typing import Any

MAX_JSON_DEPTH = 64  # arguments nested deeper are no call (content)
MAX_NAME_CHARS = 256  # a function name or key longer than this is no call
WS = " \t\r\n"

Reader = Generator[None, None, Any]  # yields: waiting for more text


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class GiveUp(Exception):
    """The text is not a call in this format."""


class Cursor:
    """The output so far (`text`), read from `base` (where its content starts: after the
    reasoning) on; `pos` only moves forward."""

    def __init__(self) -> None:
        self.text = ""
        self.base = self.pos = 0
        self.done = False
        self.started = False

    def feed(self, text: str, done: bool, base: int = 0) -> None:
        if not self.started:
            self.started, self.base, self.pos = True, base, base
        self.text, self.done = text, done


def wait_for(cur: Cursor, marker: str, frm: int | None = None) -> Reader:
    """Where `marker` starts at or after `frm` (cur.pos), waiting for text; -1 when the output
    ended without it."""
    scanned = cur.pos if frm is None else frm
    while True:
        i = cur.text.find(marker, scanned)
        if i >= 0:
            return i
        if cur.done:
            return -1
        scanned = max(scanned, len(cur.text) - len(marker) + 1)
        yield


def skip_ws(cur: Cursor, also: str = "") -> Reader:
    """The next character that is not whitespace (nor in `also`), cur.pos on it; "" at the end
    of the output."""
    while True:
        t, p = cur.text, cur.pos
        while p < len(t) and (t[p] in WS or t[p] in also):
            p += 1
        cur.pos = p
        if p < len(t):
            return t[p]
        if cur.done:
            return ""
        yield


def expect(cur: Cursor, literal: str, ws: bool = True) -> Reader:
    """True and past it when `literal` comes next (after whitespace when `ws`)."""
    if ws:
        yield from skip_ws(cur)
    while len(cur.text) - cur.pos < len(literal) and not cur.done:
        if not literal.startswith(cur.text[cur.pos:]):
            return False
        yield
    if cur.text.startswith(literal, cur.pos):
        cur.pos += len(literal)
        return True
    return False


def until_any(cur: Cursor, markers: tuple[str, ...], limit: int = MAX_NAME_CHARS) -> Reader:
    """(the text from cur.pos to the first of `markers`, that marker); cur.pos on the marker.
    GiveUp past `limit` characters or at the end of the output."""
    scanned = cur.pos
    longest = max(map(len, markers))
    while True:
        stop = cur.pos + limit + longest
        found = [(i, m) for m in markers if (i := cur.text.find(m, scanned, stop)) >= 0]
        if found:
            i, m = min(found)
            out = cur.text[cur.pos:i]
            cur.pos = i
            return out, m
        if cur.done or len(cur.text) >= stop:
            raise GiveUp
        scanned = max(scanned, len(cur.text) - longest + 1)
        yield


def text_until(cur: Cursor, marker: str, limit: int = MAX_NAME_CHARS) -> Reader:
    """The text from cur.pos to `marker` (cur.pos past the marker); GiveUp when it is longer
    than `limit` or the output ends first."""
    i = yield from _bounded_find(cur, marker, limit)
    out = cur.text[cur.pos:i]
    cur.pos = i + len(marker)
    return out


def _bounded_find(cur: Cursor, marker: str, limit: int) -> Reader:
    scanned = cur.pos
    while True:
        i = cur.text.find(marker, scanned, cur.pos + limit + len(marker))
        if i >= 0:
            return i
        if cur.done or len(cur.text) >= cur.pos + limit + len(marker):
            raise GiveUp
        scanned = max(scanned, len(cur.text) - len(marker) + 1)
        yield


_STR = re.compile(r'["\\]')
_SYNTAX = re.compile(r'["\\\[\]{}]')


def json_string(cur: Cursor, limit: int = MAX_NAME_CHARS) -> Reader:
    """A JSON string at cur.pos (its opening quote), decoded."""
    start = cur.pos
    if not (yield from expect(cur, '"', ws=False)):
        raise GiveUp
    scanned, esc_at = cur.pos, -2
    while True:
        for m in _STR.finditer(cur.text, scanned):
            if esc_at == m.start() - 1:
                esc_at = -2
            elif m.group() == "\\":
                esc_at = m.start()
            else:
                cur.pos = m.end()
                try:
                    return json.loads(cur.text[start:cur.pos])
                except ValueError:
                    raise GiveUp from None
        scanned = len(cur.text)
        if cur.done or scanned - start > limit:
            raise GiveUp
        yield


def json_value(cur: Cursor, emit: Callable[[str], None], opens: str = "{[") -> Reader:
    """One JSON object (or array) at cur.pos after whitespace; each piece of its text goes to
    `emit` as it arrives. True when it closed, False when the output ended inside it."""
    first = yield from skip_ws(cur)
    if not first or first not in opens:
        raise GiveUp
    start = sent = cur.pos
    scan = Brackets(start)
    while True:
        t = cur.text
        end = scan.feed(t, to_close=True)
        if scan.too_deep:
            raise GiveUp
        if end >= 0:
            cur.pos = end
            emit(t[sent:end])
            if valid_json(t[start:end]):
                return True
            raise GiveUp
        if len(t) > sent:
            emit(t[sent:])
            sent = len(t)
        if cur.done:
            cur.pos = len(t)
            return False
        yield


def valid_json(text: str) -> bool:
    """`text` is one JSON value (its depth was bounded by the scan that found it)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep brackets nest in `text` outside JSON strings, counted up to `limit` + 1 (one
    linear pass over the brackets, quotes and backslashes only)."""
    scan = Brackets(limit=limit)
    scan.feed(text, to_close=False)
    return scan.deepest


class Brackets:
    """The one scanner of bracketed text outside strings (quotes, backslash escapes, nesting),
    fed a text that only grows and resuming where it stopped: linear in the text, one regex of
    single characters (no backtracking). JSON by default; Python literals with `syntax`,
    `quotes`, `opens` and `closes` (tool_parsers). Two ends: `to_close`, just past the bracket
    that closes the outermost one (a value's extent); else the end of the text (its depth).
    Either stops once nesting passes `limit` (`too_deep`)."""

    def __init__(self, start: int = 0, *, limit: int = MAX_JSON_DEPTH,
                 syntax: re.Pattern[str] = _SYNTAX, quotes: str = '"', opens: str = "[{",
                 closes: str = "]}") -> None:
        self.scanned, self.limit = start, limit
        self.syntax, self.quotes, self.opens, self.closes = syntax, quotes, opens, closes
        self.depth = self.deepest = 0
        self.quote, self.esc_at = "", -2  # the open string's quote; the escaping backslash

    @property
    def too_deep(self) -> bool:
        return self.deepest > self.limit

    def feed(self, text: str, *, to_close: bool) -> int:
        """Scan `text` on from where the last call stopped: the end of the outermost bracket
        with `to_close` (-1 when the text ends first), else -1 having scanned it all."""
        for m in self.syntax.finditer(text, self.scanned):
            ch, at = m.group(), m.start()
            if self.quote:
                if self.esc_at == at - 1:  # this character is escaped
                    self.esc_at = -2
                elif ch == "\\":
                    self.esc_at = at
                elif ch == self.quote:
                    self.quote = ""
            elif ch in self.quotes:
                self.quote = ch
            elif ch in self.opens:
                self.depth += 1
                if self.depth > self.deepest:
                    self.deepest = self.depth
                    if self.deepest > self.limit:
                        self.scanned = m.end()
                        return -1
            elif ch in self.closes:
                self.depth -= 1
                if to_close and self.depth == 0:
                    self.scanned = m.end()
                    return m.end()
        self.scanned = len(text)
        return -1


def skip_value(cur: Cursor) -> Reader:
    """Past one JSON value of any kind (a key's value the reader does not need)."""
    ch = yield from skip_ws(cur)
    if ch == '"':
        yield from json_string(cur, 1 << 20)
    elif ch in "{[":
        if not (yield from json_value(cur, lambda s: None)):
            raise GiveUp
    else:
        while True:
            t, p = cur.text, cur.pos
            while p < len(t) and t[p] not in ",}] \t\r\n":
                p += 1
            cur.pos = p
            if p < len(t) or cur.done:
                return
            yield


class Sink:
    """What a format reader reports: where the calls start (`head`), each call's name, pieces
    of its arguments' JSON text, and its end."""

    def head(self, at: int) -> None:
        raise NotImplementedError

    def call(self, name: str) -> None:
        raise NotImplementedError

    def args(self, piece: str) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError

    def param_type(self, name: str, key: str) -> str | None:
        """The JSON schema type of tool `name`'s argument `key`, where the tool says."""
        return None


def call_object(cur: Cursor, sink: Sink, args_keys: tuple[str, ...]) -> Reader:
    """`{"name": NAME, "arguments": {...}}` (any of `args_keys`; other keys skipped): the call
    reported as it is read; arguments written before the name wait for it. True when the object
    closed."""
    if not (yield from expect(cur, "{")):
        raise GiveUp
    named, had_args, first, pending = False, False, True, []

    def piece(s: str) -> None:
        if named:
            sink.args(s)
        else:
            pending.append(s)

    while True:
        ch = yield from skip_ws(cur)
        if ch == "}":
            cur.pos += 1
            break
        if not first:
            if ch != ",":
                raise GiveUp
            cur.pos += 1
            ch = yield from skip_ws(cur)
        first = False
        if ch != '"':
            raise GiveUp
        key = yield from json_string(cur)
        if not (yield from expect(cur, ":")):
            raise GiveUp
        if key == "name" and not named:
            if (yield from skip_ws(cur)) != '"':
                raise GiveUp
            sink.call((yield from json_string(cur)))
            named = True
            for s in pending:
                sink.args(s)
        elif key in args_keys and not had_args:
            had_args = True
            if not (yield from json_value(cur, piece, "{")):
                return False
        else:
            yield from skip_value(cur)
    if not named:
        raise GiveUp
    if not had_args:
        sink.args("{}")
    sink.end()
    return True
