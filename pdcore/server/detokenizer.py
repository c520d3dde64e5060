"""Incremental detokenization and stop-string matching for one output sequence.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and for
sentencepiece (a lone "▁word" decodes without its space). So each step decodes a short window
(`prefix_offset:`) and emits only the part past the previously decoded window, holding text back
while it ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded ahead of the first output token so its leading space survives.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True
                 ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip,
                                clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly "")."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), emitted as is."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


class StopStringMatcher:
    """Finds the first stop string in growing text, including matches across token boundaries."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._max = max((len(s) for s in self.stops), default=0)
        self._checked = 0  # text before this index cannot start an unseen match

    def find(self, text: str) -> tuple[int, str] | None:
        """(index, stop) of the earliest match in `text`, or None."""
        if not self.stops:
            return None
        start = max(0, self._checked - self._max + 1)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        self._checked = len(text)
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that could still grow into a stop string;
        streaming withholds it so trimmed text is never sent."""
        n = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), n, -1):
                if text.endswith(s[:k]):
                    n = k
                    break
        return n
