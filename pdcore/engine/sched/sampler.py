"""Token sampling: grammar masks, penalties, logit bias, min_new_tokens, temperature, top-k,
top-p, min-p, per-request seeds, logprobs.

Logprobs are those of the model's distribution (log_softmax of the raw logits), as transformers
reports them; sampling knobs change which token is picked, not the reported logprob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdcore.engine.sched import sampler_native
from pdcore.engine.sched.sampler_native import Edits
from pdcore.errors import InvalidRequestError
from pdcore.messages.io import LogprobEntry, SamplingParams

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
    # the penalties' and bias's tokens as arrays for the native pass (None: no edits)
    edits: Edits | None = None

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int],
               eos_ids: frozenset[int] | tuple[int, ...] = (), *, resumed: int = 0,
               seed_skip: int = 0) -> SampleState:
        """`resumed`: the prompt's last tokens that are output already (a migrated request,
        GenerateReq.resumed): observed as sampled; `seed_skip`: draws a seeded generator skips."""
        gen = None
        if params.seed is not None and not params.greedy:
            seed = int(params.seed)
            if not SEED_MIN <= seed < SEED_MAX:  # torch raises a RuntimeError: a 500, not a 400
                raise InvalidRequestError(f"seed {seed} is outside [-2^63, 2^64)", "seed")
            gen = torch.Generator().manual_seed(seed)
            if seed_skip > 0:  # one uniform per sampled token (`uniforms`): the same stream
                torch.rand(seed_skip, generator=gen)
        st = cls(params, gen)
        if params.frequency_penalty or params.presence_penalty:
            st.counts = {}
        if params.repetition_penalty != 1.0:
            st.seen = set(prompt)
        if params.min_new_tokens > 0:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
            st.banned = sorted(ids) or None
        if st.seen is not None or st.counts is not None or params.logit_bias:
            st.edits = Edits(st.seen, params.logit_bias)
            if st.counts is not None:
                st.edits.track_counts()
        for token in prompt[len(prompt) - resumed:] if resumed > 0 else ():
            st.observe(token)
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
        new = self.seen is not None and token not in self.seen
        if self.seen is not None:
            self.seen.add(token)
        if self.edits is not None:
            self.edits.observe(token, new)

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


# Nucleus (top-p) filtering sorts no row: each row's tokens fall into buckets by their
# probability relative to the row's most likely token (TOP_P_PER_OCTAVE buckets per halving, the
# last bucket holding everything below 2^-(TOP_P_BUCKETS / TOP_P_PER_OCTAVE), zeros included).
# The buckets' masses, accumulated from the top, say which bucket the nucleus ends in: the
# buckets above it are kept whole, those below dropped whole, and only the tokens of that one
# bucket are ordered. The result is the full sort's (up to the order of equal probabilities).
TOP_P_PER_OCTAVE = 32
TOP_P_BUCKETS = 1024
DRAW_BLOCK = 1024  # tokens per block of the two-level draw


def processed_probs(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distributions non-greedy requests sample from, for a batch at once: temperature,
    top-k, min-p, top-p applied to rows [R, V] of (already penalized) logits, each row with its
    own request's knobs. Modifies `rows` in place (the caller's copy)."""
    n, v = rows.shape
    rows.div_(torch.tensor([p.temperature for p in params], dtype=rows.dtype).unsqueeze(1))
    ks = [p.top_k if 0 < p.top_k < v else 0 for p in params]
    sel = [i for i, k in enumerate(ks) if k]
    if sel:  # the k-th largest logit of each row, from one topk over the largest k asked
        sub = _rows(rows, sel)
        top = torch.topk(sub, max(ks[i] for i in sel), dim=-1).values
        kth = top.gather(1, torch.tensor([[ks[i] - 1] for i in sel]))
        _put(rows, sel, sub.masked_fill(sub < kth, float("-inf")))
    probs = torch.softmax(rows, -1)
    # probabilities under float32's smallest normal (< 1.2e-38 each) are zero from here on:
    # denormal operands make every later pass over the row many times slower
    probs.masked_fill_(probs < torch.finfo(probs.dtype).tiny, 0.0)
    sel = [i for i, p in enumerate(params) if p.min_p > 0]
    if sel:
        sub = _rows(probs, sel)
        floor = torch.tensor([params[i].min_p for i in sel], dtype=probs.dtype).unsqueeze(1)
        _put(probs, sel, sub.masked_fill(sub < floor * sub.amax(-1, keepdim=True), 0.0))
    sel = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if sel:
        _put(probs, sel, _top_p(_rows(probs, sel), _rows(rows, sel), torch.tensor(
            [params[i].top_p for i in sel], dtype=probs.dtype).unsqueeze(1)))
    return probs


def _rows(t: torch.Tensor, sel: list[int]) -> torch.Tensor:
    """The rows `sel` of t: t itself when that is every row (indexing by a list copies, and
    writing back through one is an element-wise scatter: several ms a step at batch 8)."""
    return t if len(sel) == t.shape[0] else t[sel]


def _put(t: torch.Tensor, sel: list[int], values: torch.Tensor) -> None:
    if values is t:
        return
    if len(sel) == t.shape[0]:
        t.copy_(values)
    else:
        t[sel] = values


def _top_p(probs: torch.Tensor, logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, in each row, the smallest set of most likely tokens whose mass exceeds top_p: a
    token is dropped when the tokens more likely than it already hold more than top_p.
    `logits` are the scaled logits `probs` is the softmax of: log2(p / p_max) is read from
    them (no logarithm of tiny probabilities: denormals are slow on every x86)."""
    n = probs.shape[0]
    last = TOP_P_BUCKETS - 1
    key = (logits.amax(-1, keepdim=True) - logits).mul_(TOP_P_PER_OCTAVE / math.log(2))
    key = key.nan_to_num_(nan=last, posinf=last).clamp_(0, last).to(torch.long)
    key.masked_fill_(probs == 0, last)  # below min_p, or underflowed
    wide = probs.to(torch.float64)
    cum = torch.zeros(n, TOP_P_BUCKETS, dtype=torch.float64).scatter_add_(1, key, wide)
    cum = cum.cumsum_(-1)
    tp = top_p.to(torch.float64)  # [n, 1]
    edge = (cum <= tp).sum(-1, keepdim=True)  # the first bucket whose inclusion passes top_p
    above = torch.where(edge > 0, cum.gather(1, (edge - 1).clamp_(min=0)), 0.0)  # [n, 1]
    out = probs.masked_fill(key > edge, 0.0)  # buckets below the edge: dropped whole
    rows, cols = (key == edge).nonzero(as_tuple=True)
    if rows.numel():  # the edge bucket's tokens, grouped by row, most likely first
        vals = wide[rows, cols]
        order = torch.sort(rows.to(torch.float64) * 2 - vals, stable=True).indices
        rows, cols, vals = rows[order], cols[order], vals[order]
        run = torch.cumsum(vals, 0)
        first = torch.zeros(n, dtype=torch.float64).index_add_(0, rows, vals).cumsum_(0) - \
            torch.zeros(n, dtype=torch.float64).index_add_(0, rows, vals)
        before = run - vals - first[rows] + above.squeeze(1)[rows]  # mass more likely
        drop = before > tp.squeeze(1)[rows]
        out[rows[drop], cols[drop]] = 0.0
    return out


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int | None]:
    """One token per row of `probs` [R, V] (rows need not sum to 1) by inverting its cumulative
    distribution at uniforms[r] in [0, 1): the first token whose cumulative mass exceeds
    u * total, never one of probability 0; None for a row with no finite positive mass. Two
    levels, in float64 where it accumulates: a block of DRAW_BLOCK tokens from the blocks'
    sums, then the token inside that block."""
    n, v = probs.shape
    pad = -v % DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(n, -1, DRAW_BLOCK)
    bcum = torch.cumsum(blocks.sum(-1).to(torch.float64), -1)
    total = bcum[:, -1]
    bad = (~torch.isfinite(total) | (total <= 0)).tolist()
    target = uniforms.to(torch.float64) * total
    b = torch.searchsorted(bcum, target.unsqueeze(1), right=True).squeeze(1)
    b = b.clamp_(max=bcum.shape[1] - 1)
    ar = torch.arange(n)
    rest = target - torch.where(b > 0, bcum[ar, (b - 1).clamp(min=0)], 0.0)
    inner = blocks[ar, b]  # [R, DRAW_BLOCK]
    icum = torch.cumsum(inner.to(torch.float64), -1)
    j = torch.searchsorted(icum, rest.unsqueeze(1), right=True).squeeze(1)
    j = j.clamp_(max=DRAW_BLOCK - 1)
    tok = (b * DRAW_BLOCK + j).clamp_(max=v - 1)
    # u * total rounded past the block's last step (float sums differ in the last bits): such a
    # row takes the block's last token with mass, or the row's
    off = (probs.gather(1, tok.unsqueeze(1)).squeeze(1) <= 0).tolist()
    out: list[int | None] = tok.tolist()
    for r in range(n):
        if bad[r]:
            out[r] = None
        elif off[r]:
            nz = inner[r].nonzero()
            out[r] = int(b[r]) * DRAW_BLOCK + int(nz[-1]) if nz.numel() else int(
                probs[r].nonzero()[-1])
    return out


def uniforms(states: list[SampleState]) -> torch.Tensor:
    """One uniform per request: from its own generator when seeded (so a seeded request draws
    the same numbers whatever its batch), else all from torch's global generator in one call.
    Each request consumes exactly one draw per sampled token, in every path (plain decoding and
    speculative verify alike)."""
    u = torch.rand(len(states))
    for i, st in enumerate(states):
        if st.generator is not None:
            u[i] = torch.rand(1, generator=st.generator)[0]
    return u


def probs_for(row: torch.Tensor, st: SampleState) -> torch.Tensor:
    """The distribution one non-greedy request samples from (one row of penalized logits)."""
    return processed_probs(row.unsqueeze(0).clone(), [st.params])[0]


def sample_one(row: torch.Tensor, st: SampleState) -> int:
    """The token plain decoding picks from one row: the argmax when greedy, else one draw
    (natively where the kernels are built, as plain decoding draws)."""
    if st.params.greedy:
        return int(row.argmax())
    o = sampler_native.op()
    if o is not None:
        t = sampler_native.run(o, row.unsqueeze(0), [_unedited(st)], uniforms([st]))[0]
        token = None if t < 0 else t
    else:
        token = draw(probs_for(row, st).unsqueeze(0), uniforms([st]))[0]
    if token is None:
        raise InvalidRequestError("no token has a finite score after this request's logit_bias, "
                                  "penalties and bans", "logit_bias")
    return token


def _unedited(st: SampleState) -> SampleState:
    """st's knobs without its edits (speculative verify's rows are sampled as given)."""
    return SampleState(st.params) if st.edits is not None or st.banned else st


RowError = tuple[str, int]  # (message, HTTP status) of one request that could not be served
NO_FINITE = ("sampling failed: no token has a finite score after this request's logit_bias, "
             "penalties and bans")


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


def _sample_batch(logits: torch.Tensor, states: list[SampleState],
                  masked: dict[int, torch.Tensor], tokens: list[int | None],
                  errors: list[RowError | None]) -> None:
    """Every row that is not plain greedy, in one vectorized pass: the rows are copied once,
    each request's penalties, bias and bans go on its own row (sparse writes), then greedy rows
    take their argmax and the others are filtered and drawn together."""
    live = [i for i, st in enumerate(states) if errors[i] is None]
    if not live:
        return
    rows = logits.clone() if len(live) == len(states) else logits[live]  # a copy either way
    ok: list[int] = []  # positions in `live`
    for j, i in enumerate(live):
        st = states[i]
        try:
            if i in masked:
                rows[j] = masked[i]
            if not st.plain_greedy:
                _penalize(rows[j], st)
            if i in masked and not torch.isfinite(rows[j]).any():
                raise InvalidRequestError(
                    "no token satisfies the grammar together with logit_bias and "
                    "min_new_tokens", st.params.grammar.field)  # type: ignore[union-attr]
            ok.append(j)
        except Exception as e:  # noqa: BLE001 - isolated to this request
            errors[i] = row_error(e, "sampling")
    greedy = [j for j in ok if states[live[j]].params.greedy]
    if greedy:
        for j, t in zip(greedy, rows[greedy].argmax(-1).tolist(), strict=True):
            tokens[live[j]] = t
    drawn = [j for j in ok if not states[live[j]].params.greedy]
    if not drawn:
        return
    sts = [states[live[j]] for j in drawn]
    probs = processed_probs(rows if len(drawn) == len(rows) else rows[drawn],
                            [st.params for st in sts])
    picked = draw(probs, uniforms(sts))
    for j, t in zip(drawn, picked, strict=True):
        if t is None:  # every token at -inf (a bias or ban on the whole vocabulary): this row
            errors[live[j]] = (NO_FINITE, 400)
        else:
            tokens[live[j]] = t


def _native_batch(o, logits: torch.Tensor, states: list[SampleState],
                  grammar: GrammarBackend | None, tokens: list[int | None],
                  errors: list[RowError | None], *, lse: list[float] | None) -> bool:
    """Every row in one native call (sampler_native); False where it cannot take this batch
    (a grammar bitmask narrower than the logits: the torch path runs instead). With `lse`,
    each sampled row's raw log-sum-exp comes back in it (logprobs from the same pass)."""
    n, v = logits.shape
    constrained = []
    for i, st in enumerate(states):
        if st.params.grammar is not None:
            try:
                st.ensure_constraint(grammar)
                constrained.append(i)
            except Exception as e:  # noqa: BLE001 - a grammar that does not compile is one row's
                errors[i] = row_error(e, "grammar")
    try:
        bitmask, mask_rows = sampler_native.bitmask_for(states, constrained, grammar, v)
    except ValueError:
        return False
    for i, st in enumerate(states):  # what the HTTP edge checks, for in-process callers
        bad = [t for t in (*st.params.logit_bias, *(st.banned or ())) if not 0 <= t < v]
        if bad and errors[i] is None:
            errors[i] = (f"token id {bad[0]} (logit_bias or stop_token_ids) is outside the "
                         f"vocabulary [0, {v})", 400)
    live = [i for i in range(n) if errors[i] is None]
    if not live:
        return True
    sts = [states[i] for i in live]
    us = torch.zeros(len(live), dtype=torch.float64)
    drawn = [j for j, st in enumerate(sts) if not st.params.greedy]
    if drawn:
        us[drawn] = uniforms([sts[j] for j in drawn]).to(torch.float64)
    rows = logits if len(live) == n else logits[live]
    out = torch.full((len(live),), float("nan"), dtype=torch.float64) if lse is not None \
        else None
    picked = sampler_native.run(o, rows, sts, us, bitmask=bitmask,
                                  mask_rows=[mask_rows[i] for i in live], lse=out)
    if lse is not None:
        for i, x in zip(live, out.tolist(), strict=True):  # type: ignore[union-attr]
            lse[i] = x
    for i, t in zip(live, picked, strict=True):
        if t >= 0:
            tokens[i] = t
        elif states[i].params.grammar is not None:
            errors[i] = row_error(InvalidRequestError(
                "no token satisfies the grammar together with logit_bias and min_new_tokens",
                states[i].params.grammar.field), "sampling")  # type: ignore[union-attr]
        else:
            errors[i] = (NO_FINITE, 400)
    return True


def sample(logits: torch.Tensor, states: list[SampleState], want_logprobs: list[int | None],
           grammar: GrammarBackend | None = None, paths: dict[str, int] | None = None,
           ) -> tuple[list[int | None], list[LogprobEntry | None], list[RowError | None]]:
    """logits [R, V] (one row per request). want_logprobs[i]: None (no logprobs) or the number
    of top logprobs to return (0 = only the chosen token's). Returns tokens, logprob entries
    and per-row errors: a row that cannot be sampled gets token None and an error, so one bad
    request never fails the others of its batch. `paths` counts the batch under the path it
    took: "greedy" (every row plain greedy: one argmax), "native" (sampler_native) or "torch"
    (the fallback; /metrics shows them)."""
    n = len(states)
    tokens: list[int | None] = [None] * n
    errors: list[RowError | None] = [None] * n
    lse: list[float] | None = None
    if all(st.plain_greedy for st in states):
        tokens, path = list(torch.argmax(logits, -1).tolist()), "greedy"
    else:
        o, path = sampler_native.op(), "native"
        lse = [math.nan] * n if any(w is not None for w in want_logprobs) else None
        if o is None or not _native_batch(o, logits, states, grammar, tokens, errors, lse=lse):
            lse, path = None, "torch"
            masked = _grammar_rows(logits, states, grammar, errors)
            _sample_batch(logits, states, masked, tokens, errors)
    if paths is not None:
        paths[path] = paths.get(path, 0) + 1
    entries: list[LogprobEntry | None] = [None] * n
    wanted = [i for i, w in enumerate(want_logprobs) if w is not None and errors[i] is None]
    if wanted:
        lp = torch.log_softmax(logits[wanted], -1) if lse is None else None
        for j, i in enumerate(wanted):
            try:
                entries[i] = logprob_entry(
                    logits[i] if lp is None else lp[j], int(tokens[i]),  # type: ignore[arg-type]
                    want_logprobs[i], 0.0 if lse is None else lse[i])  # type: ignore[arg-type]
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


def logprob_entry(lp_row: torch.Tensor, token: int, top_n: int,
                  lse: float = 0.0) -> LogprobEntry:
    """The chosen token's logprob and the top_n best, from a row of logprobs, or from a row of
    logits and its log-sum-exp `lse` (the native pass's: no log_softmax over the row)."""
    top = None
    if top_n > lp_row.numel():
        raise InvalidRequestError(f"top_logprobs_num {top_n} exceeds the vocabulary size "
                                  f"{lp_row.numel()}", "top_logprobs_num")
    if top_n > 0:
        v, ix = torch.topk(lp_row, top_n)
        top = [(x - lse, t) for x, t in zip(v.tolist(), ix.tolist(), strict=True)]
    return (float(lp_row[token]) - lse, int(token), top)
