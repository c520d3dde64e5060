"""One choice's content read for tool calls as it grows (`ToolStream`), and the whole-output
read built on it (`parse_whole`), for the parsers of server/tools/tool_parsers.py.

A stream holds content from where a call may start; once a call's name is read (and is one of
the request's tools) the stream sends it, then its arguments' JSON text in pieces as they arrive
(OpenAI's delta form: `{"index", "id", "type", "function": {"name", "arguments": ""}}` first,
then `{"index", "function": {"arguments": PIECE}}`). Text that turns out not to be a call of a
known tool before any name was sent is content after all. A finished answer (`parse_whole`) is
stricter: unless every call is complete with arguments that are JSON, it is all content (a
stream cannot take back pieces it sent).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pdcore.server.tools import tool_scan as ts
from pdcore.server.tools.tool_scan import Cursor, GiveUp, Sink

log = logging.getLogger(__name__)
MAX_PARSE_CHARS = 1 << 20  # a longer output is content: no tool calls are looked for in it


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class _Enough(Exception):
    """parallel_tool_calls false: the first call is all that is read."""


class ToolStream(Sink):
    def __init__(self, parser: Any, known: Any, parallel: bool = True) -> None:
        self.parser, self.known, self.parallel = parser, known, parallel
        self.cur = Cursor()
        self._reader = parser.read(self.cur, self)
        self.head_at: int | None = None
        self.plain = False  # no calls in this output: all of it is content
        self.stopped = False  # nothing more is read
        self.names: list[str] = []
        self.pieces: list[list[str]] = []
        self.complete: list[bool] = []
        self._events: list[tuple[int, str | None, str]] = []  # (call, name or None, piece)
        self._seen = self._visible = 0
        self._head_end: int | None = None
        self._memo: dict[str, int] = {}

    # ---- Sink: what the format's reader reports
    def head(self, at: int) -> None:
        if self.head_at is None:
            self.head_at = at

    def call(self, name: str) -> None:
        if name not in self.known:
            raise GiveUp
        if self.names and not self.parallel:
            raise _Enough
        self.names.append(name)
        self.pieces.append([])
        self.complete.append(False)
        self._events.append((len(self.names) - 1, name, ""))

    def args(self, piece: str) -> None:
        if piece and self.names:
            self.pieces[-1].append(piece)
            self._events.append((len(self.names) - 1, None, piece))

    def end(self) -> None:
        if self.complete:
            self.complete[-1] = True

    def param_type(self, name: str, key: str) -> str | None:
        schema = self.known.get(name) if isinstance(self.known, dict) else None
        props = schema.get("properties") if isinstance(schema, dict) else None
        prop = props.get(key) if isinstance(props, dict) else None
        kind = prop.get("type") if isinstance(prop, dict) else None
        return kind if isinstance(kind, str) else None

    # ---- driving
    def feed(self, text: str, done: bool, base: int = 0) -> list[tuple[int, str | None, str]]:
        """Read `text` (the output so far: it only grows; its content starts at `base`, the same
        at every call) as far as it goes; the calls' news: (index, name, "") when a call
        starts, (index, None, piece) for its arguments."""
        self._track_visible(text, base)
        if self.stopped:
            return []
        if len(text) - base > MAX_PARSE_CHARS:
            self._stop()
            return []
        self.cur.feed(text, done, base)
        try:
            next(self._reader)
            if done:  # a reader returns at the end of the output; one that waits is cut off
                self._stop()
        except StopIteration:
            self._stop()
        except (GiveUp, _Enough):
            self._stop()
        except Exception:  # noqa: BLE001 - model output must never fail a request
            log.warning("tool-call parser %s failed on an output; it is content",
                        self.parser.name, exc_info=True)
            self._stop()
        news, self._events = self._events, []
        return news

    def _stop(self) -> None:
        self.stopped = True
        if not self.names:
            self.plain = True

    def _track_visible(self, text: str, base: int) -> None:
        """Where the content's last non-whitespace character ends, from the new text only."""
        seen = max(self._seen, base)
        if len(text) > seen:
            kept = text[seen:].rstrip()
            if kept:
                self._visible = seen + len(kept)
            self._seen = len(text)
        self._visible = max(self._visible, base)

    def content_end(self, text: str, done: bool) -> int:
        """Where the content so far ends in `text` (before the first call, trailing whitespace
        held: it is dropped when a call follows; all of it without a call)."""
        base = self.cur.base
        if self.plain or (self.head_at is None and (done or self.stopped)):
            return len(text)
        if self.head_at is not None:
            if self._head_end is None:  # once
                self._head_end = base + len(text[base:self.head_at].rstrip())
            return self._head_end
        hold = self.parser.hold(self.cur, self._memo)
        if hold >= self._visible:
            return self._visible
        start = max(base, hold - 64)
        kept = text[start:hold].rstrip()
        return start + len(kept) if kept else base + len(text[base:hold].rstrip())

    def calls(self) -> list[ToolCall]:
        return [ToolCall(n, "".join(p)) for n, p in zip(self.names, self.pieces)]


def parse_whole(parser: Any, text: str, known: Any, parallel: bool = True
                ) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished output; unless it holds complete calls of known tools with
    JSON arguments, (text, [])."""
    if len(text) > MAX_PARSE_CHARS:
        return text, []
    s = ToolStream(parser, known, parallel)
    s.feed(text, True)
    calls = s.calls()
    if s.plain or not calls or not all(s.complete) or \
            not all(ts.valid_json(c.arguments) for c in calls):
        return text, []
    return text[:s.content_end(text, True)], calls
