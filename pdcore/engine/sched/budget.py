"""`--decode-step-prefill-tokens auto`: the prefill budget of a step that also runs decodes,
chosen each step from what the steps cost and what the running decodes can still afford.

A running request's TPOT is the mean gap between its tokens, (last - first) / (tokens - 1),
so one long mixed step hurts a request in proportion to how few tokens it has left to spread
the step over. Each step, for every decoding request r with k tokens out, the first sent at
t1 (the start of its first decode step), and m = min(max_new_tokens - k, HORIZON) still to
come, the step time S that keeps its mean gap at the end of those m tokens within the target
T, if the steps after this one are plain decodes of d seconds, is at most

    slack_r = T * (k - 1 + m) - (now - t1) - (m - 1) * d.

The step is allowed SHARE of the smallest slack (the next mixed steps need some too), and never
less than T itself (a step of T keeps every gap within T); requests whose slack is already
below one decode step cannot be kept within T by any budget and do not count. The prefill
tokens that fit are (allowed - d) / c, c a prefill token's cost in a step, clamped to
[FLOOR, the chunk] and to whole pages. d and c are moving averages (EWMA) of the steps rank 0
timed: d of decode-only steps, c of extend steps ((time - d for the decodes riding along) /
prefill tokens; a prefill alone: time / tokens); while the queue never empties and no step
decodes alone, d starts as a mixed step's time less its tokens' cost. Before both are known
the budget is FLOOR.

So short-lived decodes near their target keep steps small (open loop near its knee: TPOT
p99), while decodes with time in hand, e.g. many closed-loop streams whose prompts wait to be
filled, let a step carry large chunks (fewer, cheaper steps: throughput)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    from pdcore.engine.sched.request import Req

log = logging.getLogger(__name__)

FLOOR = 256  # the fixed default the goodput bench chose (docs/cpu.md): auto never goes below
HORIZON = 128  # tokens of a request's future the slack spreads a step over
SHARE = 0.5  # of the tightest slack one step may take
EMA = 0.2
MIN_CHUNK = 16  # extend steps with fewer prefill tokens teach nothing about a token's cost


def make_budget(cfg: Any, page_size: int) -> FixedBudget | PrefillBudget:
    """The budget a SchedulerConfig asks for: auto (decode_step_auto) or fixed (N, or None:
    the chunk)."""
    chunk = min(cfg.chunk_size, cfg.max_prefill_tokens)
    if cfg.decode_step_auto:
        return PrefillBudget(cfg.tpot_target_s, chunk, page_size)
    cap = cfg.decode_step_prefill
    return FixedBudget(chunk if cap is None else min(chunk, cap))


def step_counts(items: Sequence[tuple[Req, int]]) -> tuple[int, int]:
    """A scheduled step's decode rows and prefill tokens (before its results are applied: a
    decode, drafts or not, has one position left to compute)."""
    return (sum(1 for r, _ in items if r.remaining == 1),
            sum(n for r, n in items if r.remaining > 1))


class FixedBudget:
    """--decode-step-prefill-tokens N (or -1: the chunk): the same cap every mixed step."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def for_step(self, decodes: list[Req], prefill_waits: bool, now: float) -> int:
        return self.cap

    def observe(self, kind: str, took: float, items: Sequence[tuple[Req, int]]) -> None:
        pass

    def estimates(self) -> None:
        return None

    def adopt(self, est: Any) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"prefill_budget_tokens": self.cap}


class PrefillBudget:
    """The adaptive budget (module docstring). `observe` books each forward rank 0 timed;
    `tokens` answers a mixed step's budget; `estimates` / `adopt` carry rank 0's estimates to
    the other TP ranks, so every rank schedules the same step."""

    def __init__(self, target_s: float, ceiling: int, page_size: int) -> None:
        if target_s <= 0:
            raise ValueError("the TPOT target must be > 0")
        self.target = target_s
        self.ceiling = max(1, ceiling)
        self.page = max(1, page_size)
        self.floor = max(self.page, min(FLOOR, self.ceiling))
        self.decode_s: float | None = None
        self.token_s: float | None = None
        self.last = self.floor  # the budget the last mixed step was given
        self.mixed_steps = 0
        self.tokens_given = 0  # the sum of the mixed steps' budgets (/metrics: mean budget)

    # ---- learning -------------------------------------------------------------------------
    def observe(self, kind: str, took: float, items: Sequence[tuple[Req, int]]) -> None:
        """One forward: `kind` as Counters.book names it, its seconds, its items."""
        decodes, prefill = step_counts(items)
        if took <= 0:
            return
        if kind == "decode" and decodes:
            self.decode_s = _ema(self.decode_s, took)
        elif kind != "extend" or prefill < MIN_CHUNK:
            return
        elif not decodes:  # a prefill alone: its fixed cost counts in, which errs on the safe side
            self.token_s = _ema(self.token_s, took / prefill)
        elif self.decode_s is not None:  # the decodes' part known: the rest is the tokens'
            self.token_s = _ema(self.token_s, max(took - self.decode_s, 0.1 * took) / prefill)
        elif self.token_s is not None:  # no decode-only step yet (a queue never empty)
            self.decode_s = max(took - self.token_s * prefill, 0.1 * took)

    def estimates(self) -> tuple[float | None, float | None]:
        return self.decode_s, self.token_s

    def adopt(self, est: tuple[float | None, float | None] | None) -> None:
        """A TP rank takes rank 0's estimates (its own timings may differ)."""
        if est is not None:
            self.decode_s, self.token_s = est

    # ---- deciding -------------------------------------------------------------------------
    def mark(self, decodes: Iterable[Req], now: float) -> None:
        """A decode's first decode step starts about when its first token went out: t1."""
        for r in decodes:
            if r.first_token_at is None:
                r.first_token_at = now

    def allowed(self, decodes: Iterable[Req], now: float) -> float:
        """Seconds this step may take (module docstring)."""
        d, t = self.decode_s or 0.0, self.target
        tight = None
        for r in decodes:
            k, t1 = len(r.output), r.first_token_at
            if t1 is None:
                continue
            m = max(1, min(r.params.max_new_tokens - k, HORIZON))
            slack = t * (k - 1 + m) - (now - t1) - (m - 1) * d
            if slack >= d and (tight is None or slack < tight):
                tight = slack
        return t if tight is None else max(t, SHARE * tight)

    def for_step(self, decodes: list[Req], prefill_waits: bool, now: float) -> int:
        """A step running `decodes`: notes their first decode step; with prompts to fill
        (`prefill_waits`), the budget (`tokens`); else any (the ceiling)."""
        self.mark(decodes, now)
        return self.tokens(decodes, now) if prefill_waits else self.ceiling

    def tokens(self, decodes: list[Req], now: float) -> int:
        """The prefill tokens a step running `decodes` may carry."""
        if self.decode_s is None or self.token_s is None:
            n = self.floor
            allowed = None
        else:
            allowed = self.allowed(decodes, now)
            room = (allowed - self.decode_s) / self.token_s
            n = int(min(max(room, self.floor), self.ceiling))
            n = max(self.floor, n - n % self.page) if n < self.ceiling else n
        self.last = n
        self.mixed_steps += 1
        self.tokens_given += n
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prefill budget %d tokens (%d decodes; step allowed %s ms, decode %s ms, "
                      "%s ms a prefill token)", n, len(decodes), _ms(allowed),
                      _ms(self.decode_s), _ms(self.token_s))
        return n

    def stats(self) -> dict[str, float | int]:
        return {"prefill_budget_tokens": self.last,
                "prefill_budget_decode_ms": (self.decode_s or 0.0) * 1e3,
                "prefill_budget_token_ms": (self.token_s or 0.0) * 1e3,
                "prefill_budget_steps_total": self.mixed_steps,
                "prefill_budget_tokens_total": self.tokens_given}


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


def _ms(v: float | None) -> str:
    return "?" if v is None else f"{v * 1e3:.1f}"
