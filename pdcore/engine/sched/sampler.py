"""Token sampling: grammar masks, penalties, logit bias, min_new_tokens, temperature, top-k,
top-p, min-p, per-request seeds, logprobs.

Logprobs are those of the model's distribution (log_softmax of the raw logits), as transformers
reports them; sampling knobs change which token is picked, not the reported logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdcore.messages.io import LogprobEntry, SamplingParams
from pdcore.errors import InvalidRequestError

if TYPE_CHECKING:
    from pdcore.constrained.backend import Constraint, GrammarBackend

SEED_MIN, SEED_MAX = -(1 << 63), 1 << 64  # what torch.Generator.manual_seed accepts


@dataclass
class SampleState:
    """Per-request sampling state kept by the scheduler."""

    params: SamplingParams
    generator: torch.Generator | None = None
    counts: dict[int, int] | None = None  # output token counts (frequency/presence penalty)
    seen: set[int] | None = None  # prompt + output tokens (repetition penalty)
    generated: int = 0  # tokens sampled so far (on D: P's first token included)
    # EOS and stop ids, masked while fewer than min_new_tokens are out (None: nothing masked)
    banned: list[int] | None = None
    # structured output: the matcher, made at the first sampling of this request (on the rank
    # that samples); tokens observed before it exists (D: P's first token) are replayed into it
    constraint: Constraint | None = None
    unmatched: list[int] = field(default_factory=list)
    grammar_done: bool = False  # the grammar accepted a stop token: the output is complete

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int],
               eos_ids: frozenset[int] | tuple[int, ...] = ()) -> SampleState:
        gen = None
        if params.seed is not None and not params.greedy:
            seed = int(params.seed)
            if not SEED_MIN <= seed < SEED_MAX:  # torch raises a RuntimeError: a 500, not a 400
                raise InvalidRequestError(f"seed {seed} is outside [-2^63, 2^64)", "seed")
            gen = torch.Generator().manual_seed(seed)
        st = cls(params, gen)
        if params.frequency_penalty or params.presence_penalty:
            st.counts = {}
        if params.repetition_penalty != 1.0:
            st.seen = set(prompt)
        if params.min_new_tokens > 0:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
            st.banned = sorted(ids) or None
        return st

    def observe(self, token: int) -> None:
        self.generated += 1
        if self.params.grammar is not None:
            if self.constraint is None:
                self.unmatched.append(token)
            elif not self.constraint.accept(token):  # sampled under its mask: cannot happen
                raise RuntimeError(f"token {token} breaks the grammar it was sampled under")
            else:
                self.grammar_done = self.constraint.terminated
        if self.banned is not None and self.generated >= self.params.min_new_tokens:
            self.banned = None  # back on the fast path
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.seen is not None:
            self.seen.add(token)

    @property
    def plain_greedy(self) -> bool:
        return (self.params.greedy and self.counts is None and self.seen is None
                and not self.params.logit_bias and self.banned is None
                and self.params.grammar is None)

    def ensure_constraint(self, backend: GrammarBackend | None) -> Constraint:
        """The matcher, made on first use and fed the tokens observed before it existed."""
        if self.constraint is None:
            if backend is None:
                from pdcore.constrained.backend import GrammarUnavailable

                raise GrammarUnavailable("this engine has no grammar backend", "grammar")
            c = backend.constraint(self.params.grammar)  # type: ignore[arg-type]
            for tok in self.unmatched:
                if not c.accept(tok):
                    raise RuntimeError(
                        f"token {tok}, sampled before this server's matcher existed (on the "
                        "prefill server in PD), does not follow the grammar: do P and D run the "
                        "same --grammar-backend and model?")
            self.unmatched.clear()
            self.constraint = c
            self.grammar_done = c.terminated
        if self.constraint.too_slow:
            from pdcore.constrained.backend import MAX_MATCH_CALL_S

            raise InvalidRequestError(
                f"{self.constraint.field}: following this grammar took "
                f"{self.constraint.too_slow:.2f} s of CPU for one token (at most "
                f"{MAX_MATCH_CALL_S:g} s): it is too ambiguous; simplify it (nested unbounded "
                "repetitions such as ((a*)*)* slow down with every token)", self.constraint.field)
        return self.constraint


def _penalize(row: torch.Tensor, st: SampleState) -> torch.Tensor:
    p = st.params
    if st.seen:
        idx = torch.tensor(sorted(st.seen), dtype=torch.long)
        vals = row[idx]
        row[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if st.counts:
        idx = torch.tensor(list(st.counts), dtype=torch.long)
        cnt = torch.tensor(list(st.counts.values()), dtype=row.dtype)
        row[idx] -= p.frequency_penalty * cnt + p.presence_penalty
    if p.logit_bias:
        idx = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[idx] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if st.banned:
        row[torch.tensor(st.banned, dtype=torch.long)] = float("-inf")
    return row


def _sample_row(row: torch.Tensor, st: SampleState) -> int:
    if st.params.greedy:
        return int(torch.argmax(row))
    return int(torch.multinomial(probs_for(row, st), 1, generator=st.generator))


def probs_for(row: torch.Tensor, st: SampleState) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, top-k, min-p, top-p
    applied to one row of (already penalized) logits."""
    p = st.params
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, -1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, -1)
        drop = cum - sp > p.top_p  # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return probs


RowError = tuple[str, int]  # (message, HTTP status) of one request that could not be served


def row_error(e: Exception, what: str) -> RowError:
    """A per-request failure: a bad request field answers 400, anything else 500."""
    if isinstance(e, InvalidRequestError):
        return str(e), 400
    return f"{what} failed: {type(e).__name__}: {e}", 500


def _grammar_rows(logits: torch.Tensor, states: list[SampleState],
                  grammar: GrammarBackend | None, errors: list[RowError | None],
                  ) -> dict[int, torch.Tensor]:
    """Row index -> that row's logits with the tokens its grammar forbids at -inf, for every
    constrained request (one bitmask for the batch, applied in one call)."""
    rows = [i for i, st in enumerate(states) if st.params.grammar is not None]
    if not rows:
        return {}
    ok: list[int] = []
    for i in rows:
        try:
            states[i].ensure_constraint(grammar)
            ok.append(i)
        except Exception as e:  # noqa: BLE001 - a grammar that does not compile is one row's
            errors[i] = row_error(e, "grammar")
    if not ok:
        return {}
    assert grammar is not None
    bitmask = grammar.bitmask(len(ok))
    for j, i in enumerate(ok):
        states[i].constraint.fill(bitmask, j)  # type: ignore[union-attr]
    masked = logits[ok].clone()
    grammar.apply(masked, bitmask)
    return {i: masked[j] for j, i in enumerate(ok)}


def sample(logits: torch.Tensor, states: list[SampleState], want_logprobs: list[int | None],
           grammar: GrammarBackend | None = None,
           ) -> tuple[list[int | None], list[LogprobEntry | None], list[RowError | None]]:
    """logits [R, V] (one row per request). want_logprobs[i]: None (no logprobs) or the number
    of top logprobs to return (0 = only the chosen token's). Returns tokens, logprob entries
    and per-row errors: a row that cannot be sampled gets token None and an error, so one bad
    request never fails the others of its batch."""
    n = len(states)
    tokens: list[int | None] = [None] * n
    errors: list[RowError | None] = [None] * n
    if all(st.plain_greedy for st in states):
        tokens = list(torch.argmax(logits, -1).tolist())
    else:
        masked = _grammar_rows(logits, states, grammar, errors)
        for i, st in enumerate(states):
            if errors[i] is not None:
                continue
            try:
                row = masked[i] if i in masked else logits[i].clone()
                if not st.plain_greedy:
                    row = _penalize(row, st)
                if i in masked and not torch.isfinite(row).any():
                    raise InvalidRequestError(
                        "no token satisfies the grammar together with logit_bias and "
                        "min_new_tokens", st.params.grammar.field)  # type: ignore[union-attr]
                tokens[i] = _sample_row(row, st)
            except Exception as e:  # noqa: BLE001 - isolated to this request
                errors[i] = row_error(e, "sampling")
    entries: list[LogprobEntry | None] = [None] * n
    if any(w is not None for w in want_logprobs):
        lp = torch.log_softmax(logits, -1)
        for i, w in enumerate(want_logprobs):
            if w is not None and errors[i] is None:
                try:
                    entries[i] = logprob_entry(lp[i], int(tokens[i]), w)  # type: ignore[arg-type]
                except Exception as e:  # noqa: BLE001 - isolated to this request
                    errors[i] = row_error(e, "logprobs")
    for i, st in enumerate(states):
        if errors[i] is None:
            try:
                st.observe(int(tokens[i]))  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - isolated to this request
                errors[i] = row_error(e, "grammar")
        if errors[i] is not None:
            tokens[i] = None
    return tokens, entries, errors


def logprob_entry(lp_row: torch.Tensor, token: int, top_n: int) -> LogprobEntry:
    top = None
    if top_n > lp_row.numel():
        raise InvalidRequestError(f"top_logprobs_num {top_n} exceeds the vocabulary size "
                                  f"{lp_row.numel()}", "top_logprobs_num")
    if top_n > 0:
        v, ix = torch.topk(lp_row, top_n)
        top = list(zip(v.tolist(), ix.tolist()))
    return (float(lp_row[token]), int(token), top)
