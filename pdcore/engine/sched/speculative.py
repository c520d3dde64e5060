"""Speculative decoding: drafts verified in the target model's ordinary forward pass.

A decoding request whose sampling allows it (no penalties, logit_bias or pending
min_new_tokens) gets up to k draft tokens each step from the algorithm's drafter
(engine/sched/drafter.py: the interface and NGRAM, drafts from the request's own context and a
cross-request n-gram cache; engine/sched/eagle.py: EAGLE and NEXTN, a one-layer draft head
over the target's hidden states, a chain of k tokens). Whatever drafted them, the verify is the same.

The step feeds [last token, d1..dk] as one k+1-token extend over the paged pool (the
scheduler allocates pages for the drafts from free pages only, never evicting or preempting
for them); the model returns logits for all k+1 rows, and `verify` accepts the longest prefix
the target agrees with plus one token of its own:
- greedy: d_j is accepted while it equals the argmax of row j-1, so the output equals
  non-speculative greedy token for token;
- sampled: row j draws the token plain decoding would draw there (one draw from p_j, the
  request's processed distribution: temperature, top-k/p, min-p, with its generator) and d_j is
  accepted when it is that token. For a deterministic draft that is rejection sampling's
  acceptance, p_j(d_j), and the output follows the target distribution exactly; it is also the
  same samples as without speculation: a seeded request repeats whatever was drafted.
K/V of rejected positions stays in the pool beyond the request's length (overwritten by later
steps, never read); their pages beyond the sequence return to the pool at once.

Constrained requests (structured output) speculate too: with jump-forward on (TP 1) their drafts
are the tokens the grammar forces next (keys, punctuation: xgrammar's jump-forward tokens, which
may split the text otherwise than the model would), else the drafter's; `verify` masks each row
by the grammar's state after the tokens accepted before it, so the output is the one decoding a
token at a time gives.

Adaptive, so that speculation does not cost where it cannot help:
- each request's draft length follows its acceptance (all accepted: grow by 2 up to k; a
  rejection: accepted + 1), and its acceptance rate a is tracked (EMA; between verifies it
  drifts back toward the prior, so a request that stopped drafting tries again later);
- a step verifies only when it pays: with E_r = 1 + a + ... + a^k the tokens request r is
  expected to get from a verify, the step drafts when sum(E_r - 1) >= (ratio - 1) * B for its B
  decoding requests, where `ratio` is the measured time of a verify step over a decode step of
  the same batch size (EMA, measured on rank 0 and handed to the other TP ranks with each
  step's header, so every rank decides alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdcore.config import NGRAM_DRAFT_TOKENS
from pdcore.messages.io import LogprobEntry
from pdcore.engine.sched.drafter import Drafter, NgramDrafter
from pdcore.engine.sched.sampler import SampleState, logprob_entry, row_error, sample_one
from pdcore.errors import InvalidRequestError

if TYPE_CHECKING:
    from pdcore.constrained.backend import GrammarBackend
    from pdcore.engine.sched.request import Req
    from pdcore.engine.sched.sampler import RowError

PRIOR = 0.6  # acceptance rate assumed for a request that has not verified yet
DRIFT = 0.03  # per step without a verify, the acceptance estimate's move back toward PRIOR
EMA = 0.3  # weight of a new observation in the acceptance and step-time averages


@dataclass
class SpecConfig:
    algorithm: str | None = "NGRAM"  # None: jump-forward drafts only
    num_draft_tokens: int = NGRAM_DRAFT_TOKENS  # verified positions per request and step
    min_window: int = 1
    max_window: int = 12
    branch_length: int = 18  # continuation tokens kept per cross-request cache entry
    capacity: int = 100_000  # cross-request cache entries
    gate: bool = True  # verify only when it pays ($PDSERVE_SPEC_GATE=0: always)
    # a constrained request drafts the tokens its grammar forces next (xgrammar's jump-forward
    # tokens); the matcher lives on the sampling rank, so only without TP
    jump_forward: bool = False

    @property
    def ngram(self) -> bool:
        return self.algorithm == "NGRAM"

    @property
    def max_drafts(self) -> int:
        return max(0, self.num_draft_tokens - 1)


@dataclass(eq=False)
class ReqSpec:
    """One request's drafting state."""

    cap: int
    drafts: list[int] = field(default_factory=list)  # this step's (empty: none)
    index: dict[int, list[int]] = field(default_factory=dict)  # token -> its positions
    indexed: int = 0  # positions entered in `index`
    alpha: float = PRIOR  # estimated chance that a draft token is accepted
    verify_ct: int = 0  # verify passes this request took part in (meta_info spec_verify_ct)
    draft: Any = None  # the drafter's own state for this request (EAGLE: its next draft input)


def eligible(req: Req) -> bool:
    """Sampling that a verify pass reproduces exactly: per-row distributions that do not depend
    on the tokens accepted before them in the same pass. Read from the request's parameters and
    tokens only, which every TP rank has (the sampling state advances on rank 0 alone)."""
    p = req.params
    return (p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and not p.logit_bias
            and len(req.output) >= p.min_new_tokens)


class Speculator:
    """Drafts for a decode batch (a `Drafter` per algorithm: engine/sched/drafter.py, NGRAM;
    engine/sched/eagle.py, EAGLE), the cost gate and the verify bookkeeping, shared by all."""

    def __init__(self, cfg: SpecConfig, drafter: Drafter | None = None) -> None:
        self.cfg = cfg
        self.drafter = drafter if drafter is not None else (
            NgramDrafter(cfg) if cfg.ngram else None)
        self.steps = self.verifies = self.proposed = self.accepted = self.emitted = 0
        self.seconds = 0.0  # forward time of decode steps that verified drafts
        self.ratio = 1.5  # verify step time / decode step time at the same batch (measured)
        self._decode_s: dict[int, float] = {}  # batch size -> decode step seconds (EMA)
        self.gated = 0  # steps whose drafts were dropped because they would not pay
        self.forced = 0  # draft tokens a grammar forced (jump-forward)

    @property
    def cache(self) -> Any:
        """NGRAM's cross-request n-gram cache (None for other drafters)."""
        return getattr(self.drafter, "cache", None)

    @property
    def needs_hidden(self) -> bool:
        return self.drafter is not None and self.drafter.needs_hidden

    # ---- drafting ----------------------------------------------------------------------------
    def propose(self, req: Req, budget: int) -> list[int]:
        """Draft tokens for `req` (at most `budget`); sets req.spec.drafts."""
        self.propose_all([req], [budget])
        return req.spec.drafts

    def propose_all(self, reqs: list[Req], budgets: list[int]) -> None:
        """Each request's drafts for this step (at most its budget and its cap) into
        req.spec.drafts: a constrained request's forced tokens (jump-forward), else the
        drafter's, asked for the whole batch at once."""
        ask: list[tuple[Req, int]] = []
        for req, budget in zip(reqs, budgets):
            sp = req.spec
            if sp is None:
                sp = req.spec = ReqSpec(cap=self.cfg.max_drafts)
            sp.drafts = []
            k = min(sp.cap, budget)
            if k <= 0 or not eligible(req):
                continue
            st = req.state
            if self.cfg.jump_forward and st.constraint is not None and not st.grammar_done:
                forced = st.constraint.jump_tokens()
                if forced:
                    sp.drafts = forced[:k]
                    self.forced += len(sp.drafts)
                    continue
            if self.drafter is not None:
                ask.append((req, k))
        if ask:
            drafts = self.drafter.propose([r for r, _ in ask], [k for _, k in ask])
            for (req, k), d in zip(ask, drafts):
                req.spec.drafts = list(d[:k])

    def before_forward(self) -> None:
        """Right before the target's forward (DP attention: a MoE head's padded passes)."""
        if self.drafter is not None:
            self.drafter.before_forward()

    def observe(self, items: list[tuple[Req, int]], results: list[Any]) -> None:
        """A target forward's results, before the scheduler applies them (the drafter's)."""
        if self.drafter is not None:
            self.drafter.observe(items, results)

    def remember(self, req: Req) -> None:
        """A finished request (NGRAM: its output enters the cross-request cache)."""
        if self.drafter is not None:
            self.drafter.remember(req)

    def select(self, reqs: list[Req]) -> None:
        """Keep this step's drafts only if the verify pays for the whole batch (module doc)."""
        gain = 0.0
        for r in reqs:
            sp = r.spec
            if sp is not None and sp.drafts:
                a = min(sp.alpha, 0.999)
                gain += (a - a ** (len(sp.drafts) + 1)) / (1 - a)  # E_r - 1
        if self.cfg.gate and gain and gain < (self.ratio - 1) * len(reqs):
            self.gated += 1
            for r in reqs:
                if r.spec is not None:
                    r.spec.drafts = []
        for r in reqs:  # not verifying this step: the estimate drifts back toward the prior
            sp = r.spec
            if sp is not None and not sp.drafts:
                sp.alpha += DRIFT * (PRIOR - sp.alpha)

    def timed(self, batch: int, seconds: float, verify: bool) -> None:
        """One decode-phase step's forward time (rank 0 measures; see `ratio`); a verify step's
        is also booked in the verify steps' count and seconds."""
        if verify:
            self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        else:
            old = self._decode_s.get(batch)
            self._decode_s[batch] = seconds if old is None else old + EMA * (seconds - old)
            return
        base = self._decode_s.get(batch)
        if base:
            self.ratio = max(1.0, self.ratio + EMA * (seconds / base - self.ratio))

    # ---- after the verify pass -----------------------------------------------------------------
    def verified(self, req: Req, drafts: list[int], tokens: list[int]) -> None:
        """Book one verify of `req`: `tokens` came out of `drafts` (the accepted ones are their
        agreeing prefix; a grammar that ends on a draft leaves no token of the target's)."""
        sp = req.spec
        proposed, emitted = len(drafts), len(tokens)
        accepted = next((i for i, (t, d) in enumerate(zip(tokens, drafts)) if t != d),
                        min(proposed, emitted))
        self.verifies, self.proposed = self.verifies + 1, self.proposed + proposed
        self.accepted, self.emitted = self.accepted + accepted, self.emitted + emitted
        sp.verify_ct += 1
        if proposed:
            sp.alpha += EMA * (accepted / proposed - sp.alpha)
        sp.cap = (min(self.cfg.max_drafts, sp.cap + 2) if accepted >= proposed
                  else max(1, accepted + 1))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec_cache_entries": 0}
        if self.drafter is not None:
            out.update(self.drafter.stats())
        return {**out,
            "spec_verify_steps_total": self.steps, "spec_verify_seconds_total": self.seconds,
            "spec_verifies_total": self.verifies,
            "spec_draft_tokens_total": self.proposed,
            "spec_accepted_tokens_total": self.accepted,
            "spec_emitted_tokens_total": self.emitted,
            "spec_accept_length": self.emitted / self.verifies if self.verifies else 0.0,
            "spec_accept_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_cost_ratio": self.ratio,
            "spec_gated_steps_total": self.gated, "spec_jump_forward_tokens_total": self.forced,
        }


def verify(rows: torch.Tensor, st: SampleState, drafts: list[int], want: int | None,
           grammar: GrammarBackend | None = None,
           ) -> tuple[list[int], list[LogprobEntry], RowError | None]:
    """rows [k+1, V]: the target's logits after the current token and after each draft.
    Returns the tokens the request gets (accepted drafts + one of the target's), their logprob
    entries (when `want` is not None) and an error (then no tokens).

    Row by row, the choice plain decoding would make there (`_choose`), observed into the
    sampling state as it is made; a constrained request's row is first masked by its grammar's
    state after the tokens accepted before it. The walk stops at the first token that is not
    the draft, or where the grammar ends."""
    try:
        masked = st.params.grammar is not None
        if masked:
            c = st.ensure_constraint(grammar)
            assert grammar is not None  # ensure_constraint raised otherwise
            mask = grammar.bitmask(1)
        out: list[int] = []
        for j in range(len(drafts) + 1):
            row = rows[j]
            if masked:
                c.fill(mask, 0)
                row = row.unsqueeze(0).clone()
                grammar.apply(row, mask)  # type: ignore[union-attr]
                row = row[0]
                if not torch.isfinite(row).any():
                    raise InvalidRequestError("no token satisfies the grammar",
                                              st.params.grammar.field)  # type: ignore[union-attr]
            d = drafts[j] if j < len(drafts) else None
            t = _choose(row, st, d)
            st.observe(t)
            out.append(t)
            if t != d or st.grammar_done:
                break
        entries: list[LogprobEntry] = []
        if want is not None:
            lp = torch.log_softmax(rows[: len(out)], -1)
            entries = [logprob_entry(lp[j], t, want) for j, t in enumerate(out)]
        return out, entries, None
    except Exception as e:  # noqa: BLE001 - isolated to this request
        return [], [], row_error(e, "speculative verify")


def _choose(row: torch.Tensor, st: SampleState, draft: int | None) -> int:
    """The token at one row: exactly the choice plain decoding makes there (greedy's argmax, or
    one draw from the request's generator), whatever the draft; the caller keeps the draft when
    it is that token. For a deterministic draft (NGRAM's, a head's argmax chain, a grammar's
    forced tokens) this accepts with probability p(draft), as rejection sampling does, and the
    output follows p; and it consumes the generator one draw per emitted token, as plain
    decoding does, so a seeded request repeats whatever was drafted (the cross-request n-gram
    cache, the cost gate and the batch change the drafts, never the tokens; #45 item 9)."""
    del draft
    return sample_one(row, st)
