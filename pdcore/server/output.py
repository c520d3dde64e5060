"""Turns a request's stream of TokenOut messages into text, ids, logprobs and a finish reason.

Stop strings and stop token ids are applied here (the scheduler only sees token ids): the first
match ends the sequence; the caller then aborts the scheduler request so its pages are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcore.messages.io import LogprobEntry, SamplingParams, TokenOut
from pdcore.server.detokenizer import IncrementalDetokenizer, StopStringMatcher


@dataclass
class SequenceOutput:
    """What the routes read: cumulative state of one output sequence."""

    rid: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0  # speculative decoding's verify passes (from the last message)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] | None = None
    finished: bool = False
    finish_reason: dict[str, Any] | None = None


class OutputAssembler:
    def __init__(self, tokenizer: Any, rid: str, prompt_ids: list[int],
                 sampling: SamplingParams, discard_output: bool = False) -> None:
        self.out = SequenceOutput(rid=rid, prompt_tokens=len(prompt_ids))
        # max_new_tokens 0 (prompt logprobs only): the scheduler makes one token, we drop it
        self._discard = discard_output
        self._sampling = sampling
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, sampling.skip_special_tokens)
        self._stops = StopStringMatcher(list(sampling.stop))
        self._stop_ids = set(sampling.stop_token_ids)
        self._full = ""  # text before stop trimming
        self.ended_here = False  # True when a stop string / id ended it before the scheduler did
        self.resumed = 0  # output tokens an earlier leg streamed (`resume`)
        self.resumed_visible = 0  # the length of the text that leg's client has seen

    def resume(self, ids: list[int]) -> None:
        """A migrated request: start from the output an earlier leg streamed (no stop matched
        there, or it would have ended); the prompt the scheduler reports includes them."""
        for tok in ids:
            self.out.output_ids.append(tok)
            self._full += self._detok.add(tok)
        self.out.text = self._full
        self.resumed = len(ids)
        self.resumed_visible = len(self.visible_text())

    def feed(self, msg: TokenOut) -> bool:
        """Consume one scheduler message; True once the sequence is finished."""
        o = self.out
        if o.finished:
            return True
        if msg.prompt_tokens:
            o.prompt_tokens = msg.prompt_tokens - self.resumed
        o.cached_tokens = max(o.cached_tokens, msg.cached_tokens)
        o.spec_verify_ct = max(o.spec_verify_ct, msg.spec_verify_ct)
        if msg.input_logprobs is not None:
            o.input_logprobs = list(msg.input_logprobs)
        sched_reason = msg.finish_reason if msg.finished else None
        if self._discard:
            if msg.finished:
                self._finish({"type": "length", "length": 0}, trim_token=False)
            return o.finished
        n = len(msg.new_token_ids)
        for i, tok in enumerate(msg.new_token_ids):
            o.output_ids.append(tok)
            if i < len(msg.output_logprobs):
                o.output_logprobs.append(msg.output_logprobs[i])
            last = i == n - 1
            if tok in self._stop_ids and not (last and sched_reason):
                self._finish({"type": "stop", "matched": tok}, trim_token=True)
                self.ended_here = True
                return True
            if last and sched_reason and sched_reason.get("type") == "stop" \
                    and isinstance(sched_reason.get("matched"), int) \
                    and sched_reason["matched"] == tok and not self._sampling.no_stop_trim:
                break  # a matched stop token (EOS included) is not part of the text
            self._full += self._detok.add(tok)
            hit = self._stops.find(self._full)
            if hit is not None:
                idx, s = hit
                end = idx + len(s) if self._sampling.no_stop_trim else idx
                o.text = self._full[:end]
                o.finished = True
                o.finish_reason = {"type": "stop", "matched": s}
                self.ended_here = not (last and sched_reason)
                return True
        if msg.finished:
            self._finish(sched_reason or {"type": "length", "length": len(o.output_ids)},
                         trim_token=False)
            return True
        o.text = self._full
        return False

    def _finish(self, reason: dict[str, Any], trim_token: bool) -> None:
        o = self.out
        if trim_token and self._sampling.no_stop_trim:
            self._full += self._detok.add(o.output_ids[-1])
        self._full += self._detok.flush()
        o.text = self._full
        o.finished = True
        o.finish_reason = reason

    def visible_text(self) -> str:
        """Text that is safe to stream now: withholds a tail that may become a stop string."""
        o = self.out
        if o.finished:
            return o.text
        return o.text[: len(o.text) - self._stops.holdback(o.text)]
