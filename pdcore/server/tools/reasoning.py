"""Reasoning output, as SGLang's `--reasoning-parser` names the formats: the text of the model's
thinking block goes to `reasoning_content`, the rest to `content`.

- `deepseek-r1`, `qwen3-thinking`: the chat template opens the thinking block in the prompt, so
  the output starts inside it (a leading `<think>` is dropped too); without `</think>` all of it
  is reasoning;
- `qwen3`, `glm45`, `deepseek-v3`: reasoning only when the output opens with `<think>`
  (templates that let a request turn thinking off); otherwise all is content;
- `kimi`: the same with `◁think▷` ... `◁/think▷`;
- `gpt-oss` (harmony): the `analysis` channel's message is the reasoning, the `final`
  channel's is the content (its header dropped; a `commentary` tool call stays for the tool
  parser).

A splitter reads one choice's output as it grows, once (linear over a whole stream), and never
takes back what it gave: a stream sends each part's new end as a delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcore.server.tools.tool_scan import partial_tail


@dataclass(frozen=True)
class Style:
    open: str
    close: str
    inside: bool  # the output starts inside the block
    header: tuple[str, ...] = ()  # dropped where content starts (gpt-oss's final channel)
    special: bool = False  # its markers are special tokens: the output must keep them


OPEN, CLOSE = "<think>", "</think>"
_THINK, _FORCED = Style(OPEN, CLOSE, False), Style(OPEN, CLOSE, True)
_HARMONY_FINAL = ("<|start|>assistant", "<|channel|>final<|message|>")
STYLES = {
    "deepseek-r1": _FORCED, "qwen3-thinking": _FORCED, "qwen3": _THINK, "glm45": _THINK,
    "deepseek-v3": _THINK, "kimi": Style("◁think▷", "◁/think▷", False),
    "gpt-oss": Style("<|channel|>analysis<|message|>", "<|end|>", False, _HARMONY_FINAL,
                     True),
}
NAMES = tuple(STYLES)  # --reasoning-parser's choices


class ReasoningParser:
    """A server's --reasoning-parser; `splitter()` gives each choice its own reader."""

    def __init__(self, name: str) -> None:
        if name not in STYLES:
            raise ValueError(f"reasoning parser {name!r}: expected one of {', '.join(NAMES)}")
        self.name, self.style = name, STYLES[name]

    def splitter(self) -> Splitter:
        return Splitter(self.style)

    def split(self, text: str, done: bool = True) -> tuple[str, str]:
        """(reasoning, content) of `text` in one go."""
        return self.splitter().split(text, done)


class Splitter:
    def __init__(self, style: Style) -> None:
        self.s = style
        self.state = "start"  # start: the opening not decided; in: reasoning; out: content
        self.r0 = self.r1 = self.c0 = 0  # reasoning text[r0:r1], content text[c0:]
        self.scanned = 0  # where the search for the close resumes
        self.headers = 0  # header markers checked (gpt-oss)

    def split(self, text: str, done: bool = True) -> tuple[str, str]:
        """(reasoning, content) of the output so far (`text` only grows between calls). Unless
        `done`, an end of `text` that may be the start of a marker is in neither yet."""
        r0, r1, c0 = self.spans(text, done)
        return text[r0:r1], text[c0:] if c0 is not None else ""

    def spans(self, text: str, done: bool = True) -> tuple[int, int, int | None]:
        """(r0, r1, c0): the reasoning is text[r0:r1], the content text[c0:] (c0 None: none
        yet). Each call reads only what arrived since the last one, up to a marker's length."""
        s = self.s
        if self.state == "start":
            self.r0 = _visible(text, self.r0)
            head = text[self.r0:self.r0 + len(s.open)]
            if not done and len(head) < len(s.open) and s.open.startswith(head):
                return 0, 0, None  # could still become the opening
            if head == s.open:
                self.state, self.r0 = "in", self.r0 + len(s.open)
            elif s.inside:
                self.state = "in"
            elif s.header:
                self.state, self.c0, self.r0 = "header", self.r0, 0
            else:
                self.state, self.c0, self.r0 = "out", 0, 0
        if self.state == "in":
            if self.r1 <= self.r0:  # the reasoning starts at its first visible character
                self.r0 = _visible(text, self.r0)
            i = text.find(s.close, max(self.scanned, self.r0))
            if i < 0:
                self.scanned = max(self.r0, len(text) - len(s.close) + 1)
                self.r1 = len(text) - (0 if done else partial_tail(text, s.close))
                self.r1 = max(self.r1, self.r0)
                return self.r0, self.r1, None
            self.r1, self.c0 = i, i + len(s.close)
            self.state = "header" if s.header else "lead"
        while self.state == "header":  # gpt-oss: the final channel's header is no content
            if self.headers == len(s.header):
                self.state = "lead"
                break
            h = s.header[self.headers]
            self.c0 = _visible(text, self.c0)
            if text.startswith(h, self.c0):
                self.c0 += len(h)
            elif not done and len(text) - self.c0 < len(h) and h.startswith(text[self.c0:]):
                return self.r0, self.r1, None
            self.headers += 1
        if self.state == "lead":  # the content starts at its first visible character
            self.c0 = _visible(text, self.c0)
            if self.c0 < len(text) or done:
                self.state = "out"
        return self.r0, self.r1, self.c0 if self.state == "out" else None


def _visible(text: str, i: int) -> int:
    """Where the first non-whitespace character at or after `i` is (len(text): none)."""
    return len(text) - len(text[i:].lstrip())


PARSERS = {name: (lambda n=name: ReasoningParser(n)) for name in NAMES}  # fuzz suites list it
