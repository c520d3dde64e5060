"""Reasoning output, as SGLang's `--reasoning-parser` names the formats: the text between
`<think>` and `</think>` goes to `reasoning_content`, the rest to `content`.

- `deepseek-r1`: the chat template opens the thinking block in the prompt, so the output starts
  inside it (a leading `<think>` is dropped too); without `</think>` everything is reasoning.
- `qwen3`: reasoning only when the output opens with `<think>`; otherwise all is content.
"""

from __future__ import annotations

from pdcore.server.tool_parsers import partial_tail

NAMES = ("deepseek-r1", "qwen3")  # --reasoning-parser's choices
OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in NAMES:
            raise ValueError(f"reasoning parser {name!r}: expected one of {', '.join(NAMES)}")
        self.name = name

    def split(self, text: str, done: bool = True) -> tuple[str, str]:
        """(reasoning, content). Unless `done`, characters at the end of `text` that may be the
        start of a marker are in neither yet."""
        body = text.lstrip()
        if not done and OPEN.startswith(body):  # could still become "<think>"
            return "", ""
        opened = body.startswith(OPEN)
        if self.name == "qwen3" and not opened:
            return "", text
        if opened:
            body = body[len(OPEN):].lstrip()
        # every piece only grows as `text` does: a stream sends each one's new end as a delta
        if CLOSE in body:
            reasoning, content = body.split(CLOSE, 1)
            return reasoning, content.lstrip()
        held = 0 if done else partial_tail(body, CLOSE)
        return body[:len(body) - held], ""


PARSERS = {name: (lambda n=name: ReasoningParser(n)) for name in NAMES}  # fuzz suites list it
