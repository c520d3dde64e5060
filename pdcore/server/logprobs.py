"""Logprob entries (logprob, token_id, top) from the scheduler, in the three public shapes:
SGLang-native lists, OpenAI completions `logprobs`, OpenAI chat `logprobs.content`."""

from __future__ import annotations

from typing import Any

from pdcore.messages.io import LogprobEntry


class TokenText:
    """Cached id -> text for logprob payloads."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s


def _lp(x: Any) -> float | None:
    return None if x is None else float(x)


def native(entries: list[LogprobEntry] | None, text: TokenText | None
           ) -> tuple[list[list[Any]], list[Any]]:
    """(token_logprobs, top_logprobs): [[logprob, id, text|None], ...] and per position
    [[logprob, id, text|None], ...] or None."""
    toks: list[list[Any]] = []
    tops: list[Any] = []
    for lp, tid, top in entries or []:
        toks.append([_lp(lp), int(tid), text(tid) if text else None])
        tops.append(None if top is None else
                    [[_lp(t_lp), int(t_id), text(t_id) if text else None] for t_lp, t_id in top])
    return toks, tops


def completion(entries: list[LogprobEntry], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for lp, tid, top in entries:
        s = text(tid)
        tokens.append(s)
        token_lps.append(_lp(lp))
        tops.append(None if top is None else {text(t): _lp(t_lp) for t_lp, t in top})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat(entries: list[LogprobEntry], text: TokenText, with_top: bool) -> list[dict[str, Any]]:
    """OpenAI chat shape: the list under `logprobs.content`."""
    out = []
    for lp, tid, top in entries:
        s = text(tid)
        item: dict[str, Any] = {"token": s, "logprob": _lp(lp), "bytes": list(s.encode()),
                                "top_logprobs": []}
        if with_top and top is not None:
            item["top_logprobs"] = [{"token": text(t), "logprob": _lp(t_lp),
                                     "bytes": list(text(t).encode())} for t_lp, t in top]
        out.append(item)
    return out
