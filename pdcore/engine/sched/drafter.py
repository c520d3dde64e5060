"""Where draft tokens come from: the interface every speculative algorithm's drafter implements,
and the NGRAM drafter.

The speculator (engine/sched/speculative.py) owns everything the algorithms share: which
requests may draft and how many tokens (their budget and adaptive cap), jump-forward drafts of
constrained requests, the cost gate, the verify pass and its bookkeeping. A drafter only says
which tokens to try:
- `propose(reqs, wants)`: up to wants[i] draft tokens for reqs[i], for the whole decode batch
  at once (a draft model runs its passes batched);
- `observe(items, results)`: after every target forward, before its tokens are applied (a draft
  model reads the target's hidden states of the positions it just computed);
- `remember(req)`: a request that finished (NGRAM's cross-request cache).

NGRAM: the continuation that followed the latest earlier occurrence of the context's longest
matching suffix (`--speculative-ngram-min/max-match-window-size`), in the request's own prompt
and output first, else in a bounded cache of n-grams from earlier requests
(`--speculative-ngram-capacity` entries). No draft model: a dictionary lookup per request.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdcore.engine.sched.request import Req

CANDIDATES = 8  # latest occurrences of the last token examined per lookup
CACHE_KEY = 3  # tokens of context that key the cross-request cache


class Drafter:
    """What a speculative algorithm supplies (see the module docstring)."""

    needs_hidden = False  # the target forward must hand over its hidden states

    def propose(self, reqs: list[Req], wants: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def before_forward(self) -> None:
        """Right before the target's forward (a MoE head under DP attention pads its passes)."""

    def observe(self, items: list[tuple[Req, int]], results: list[Any]) -> None:
        """A target forward ran `items`; `results` are their StepResults (engine/sched/batch_run.py),
        not applied yet."""

    def remember(self, req: Req) -> None:
        """`req` finished without an error."""

    def stats(self) -> dict[str, Any]:
        return {}


class NgramDrafter(Drafter):
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the speculator's SpecConfig (windows, branch length, capacity)
        self.cache: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def propose(self, reqs: list[Req], wants: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, wants):
            own, matched = self._own(req, req.spec, k)
            # the longer match predicts better: a cached continuation (keyed by CACHE_KEY
            # tokens) beats an own-context match that is not longer than its key
            out.append(own if matched > CACHE_KEY else (self._cached(req, k) or own))
        return out

    def _own(self, req: Req, sp: Any, k: int) -> tuple[list[int], int]:
        """The continuation of the latest longest match of the context's suffix in the
        context itself, and the match's length (0: none)."""
        n = req.seq_len
        for p in range(sp.indexed, n - 1):  # every position but the last: a match needs a next
            sp.index.setdefault(req.token_at(p), []).append(p)
        sp.indexed = max(sp.indexed, n - 1)
        cands = sp.index.get(req.token_at(n - 1))
        if not cands:
            return [], 0
        best, best_len = -1, 0
        for p in reversed(cands[-CANDIDATES:]):
            m = 1
            while m < self.cfg.max_window and p - m >= 0 \
                    and req.token_at(p - m) == req.token_at(n - 1 - m):
                m += 1
            if m > best_len:
                best, best_len = p, m
                if m >= self.cfg.max_window:
                    break
        if best_len < self.cfg.min_window:
            return [], 0
        return [req.token_at(q) for q in range(best + 1, min(best + 1 + k, n))], best_len

    def _cached(self, req: Req, k: int) -> list[int]:
        n = req.seq_len
        if not self.cache or n < CACHE_KEY:
            return []
        key = tuple(req.token_at(p) for p in range(n - CACHE_KEY, n))
        hit = self.cache.get(key)
        if hit is None:
            return []
        self.cache.move_to_end(key)
        return hit[:k]

    def remember(self, req: Req) -> None:
        """A finished request's output enters the cross-request cache."""
        if self.cfg.capacity <= 0 or not req.output:
            return
        seq = req.prompt[-CACHE_KEY:] + req.output
        for i in range(len(seq) - CACHE_KEY):
            key = tuple(seq[i : i + CACHE_KEY])
            self.cache[key] = seq[i + CACHE_KEY : i + CACHE_KEY + self.cfg.branch_length]
            self.cache.move_to_end(key)
        while len(self.cache) > self.cfg.capacity:
            self.cache.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        return {"spec_cache_entries": len(self.cache)}
