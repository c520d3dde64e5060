"""Continuous batching with chunked prefill, a token budget and preemption.

Each step:
1. the role extension (if any: pdcore.engine.sched.extension) advances its queues;
2. every running request that needs one position (decode) gets it; pages are allocated, and
   when the pool runs out the prefix cache gives back its least recently used unlocked pages,
   then the newest running request is preempted (its pages go to the cache, it is recomputed
   later from its prompt + output, starting from whatever of it is still cached);
3. the prefill budget (`--chunked-prefill-size`, `--max-prefill-tokens`; no more than
   `--decode-step-prefill-tokens` when the step also runs decodes, so their gap between tokens
   stays bounded while a lone prompt still prefills in whole chunks) is spent on partly
   filled requests, then on waiting ones (up to `--max-running-requests`, in arrival order or,
   with `--schedule-policy lpm`, longest cached prefix first); a request taken from the queue
   first takes the cached pages of its prompt's longest prefix (pdcore.engine.kv.radix) and
   computes only the rest; full pages enter the cache after every chunk and at its end;
4. one packed forward pass; requests that reached the end of their sequence sample a token;
5. finish checks (eos, stop ids, max_new_tokens, context length), then outputs are collected.

The scheduler decides what runs and applies what came out; it never runs a model. The step
that joins it to the runner and the speculator is `pdcore.engine.loop.StepLoop`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdcore.messages.io import TokenOut
from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.kv.radix import RadixCache
from pdcore.engine.model.layers import TPInfo
from pdcore.engine.sched.budget import make_budget
from pdcore.engine.sched.extension import Extension
from pdcore.engine.sched.outputs import take_output
from pdcore.engine.sched.pages import KVPages
from pdcore.engine.sched.request import Phase, Req
from pdcore.engine.sched.stats import Counters
from pdcore.errors import InvalidRequestError

if TYPE_CHECKING:
    from pdcore.engine.sched.extension import ModelSide
    from pdcore.engine.sched.batch_run import StepResult

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_running: int = 64
    chunk_size: int = 2048
    max_prefill_tokens: int = 8192
    # --decode-step-prefill-tokens: the prefill budget of a step that also runs decodes (None:
    # the same as a step without: the chunk); `auto` (decode_step_auto) chooses it each step
    # (engine/sched/budget.py) to keep the decodes' TPOT within --decode-tpot-target-ms
    decode_step_prefill: int | None = None
    decode_step_auto: bool = False
    tpot_target_s: float = 0.1
    context_length: int = 8192
    eos_ids: frozenset[int] = frozenset()
    schedule_policy: str = "fcfs"  # or "lpm": longest cached prefix first
    # --schedule-conservativeness C: above 1, a new prompt is admitted only while (C - 1) x
    # (at most all of) the pages the running requests' remaining outputs need stay free
    conservativeness: float = 1.0


# lpm sorts the queue by prefix match each step; past this length it costs more than it saves
# and the queue runs fcfs (SGLang makes the same switch)
LPM_MAX_QUEUE = 128


class Scheduler:
    def __init__(self, blocks: BlockManager, cfg: SchedulerConfig,
                 cache: RadixCache | None = None, tp: TPInfo | None = None,
                 side: ModelSide | None = None) -> None:
        self.blocks, self.cfg = blocks, cfg
        # what a role extension may read of the model side (engine/sched/api.py); the
        # scheduler itself never reads it
        self.side = side
        self.cache = cache  # None: --disable-radix-cache (or a decode server without its own)
        self.pages = KVPages(blocks, cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.outbox: list[TokenOut] = []
        self.counters = Counters()
        self.gemm_layouts: dict[str, int] | None = None  # GEMM weights per layout (_native_stats)
        self.ext = Extension()
        self.last_ran = False  # the last step did work: the loop calls again without waiting
        self.flushed_early = False  # the last step only sent tokens that arrived in poll()
        self.uncollected = False
        self.dropped: list[Req] = []  # dropped since the step loop last looked (take_dropped)
        self.tp = tp or TPInfo()  # a role extension agrees on per-request states over its group
        self.step_time: float | None = None  # rank 0's clock for this step (set under TP)
        self.budget = make_budget(cfg, blocks.page_size)  # a mixed step's (engine/sched/budget.py)

    def now(self) -> float:
        """The step's time: the same value on every TP rank, so time-based decisions agree."""
        return self.step_time if self.step_time is not None else time.monotonic()

    # ---- intake -----------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        n = len(req.prompt)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "text")
        if n >= self.cfg.context_length:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; the context length is {self.cfg.context_length}",
                "text")
        if self.blocks.pages_for(n + 1) > self.blocks.num_pages:
            raise InvalidRequestError(
                f"the prompt needs {self.blocks.pages_for(n + 1)} KV pages; the pool has "
                f"{self.blocks.num_pages} (raise --max-total-tokens)", "text")

    def add(self, req: Req) -> None:
        try:
            self.validate(req)
        except InvalidRequestError as e:
            self.refuse(req.rid, str(e), 400)
            return
        self.reqs[req.rid] = req
        self.counters.prompt_tokens += len(req.prompt)
        if not self.ext.admit(req):
            self.enqueue(req)

    def enqueue(self, req: Req, front: bool = False) -> None:
        req.phase = Phase.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        self.ext.on_abort(req)
        self.counters.aborted += 1
        self.finish(req, {"type": "abort", "message": reason}, drop_ext=False)

    def fail(self, req: Req, message: str, status: int = 500, code: str | None = None) -> None:
        req.error, req.error_status, req.error_code = message, status, code
        self.ext.on_abort(req)
        self.finish(req, {"type": "abort", "message": message}, drop_ext=False)

    def _admit(self, req: Req, budget: int) -> int:
        """Pages for the next chunk of a request from the queue (its cached prefix first);
        the chunk's length, or 0 when the pool cannot hold it (it keeps nothing then)."""
        fresh = not req.pages and req.num_computed == 0
        if fresh:
            req.num_computed = self.pages.attach_prefix(req, self.pages.match_limit(req))
        n = min(req.remaining, budget)
        if self.pages.ensure(req, req.num_computed + n):
            if fresh and not req.preempted:
                req.cached_tokens = req.num_computed
                self.counters.cached_tokens += req.num_computed
            return n
        if fresh and req.pages:
            self.blocks.free(req.pages)  # give the matched pages back; matched again later
            req.pages, req.ctx_slots, req.num_computed = [], None, 0
        return 0

    def _order_waiting(self) -> None:
        """lpm: requests with the longest cached prefix first (preempted or partly filled ones
        stay ahead, in their order); ties keep arrival order."""
        if self.cfg.schedule_policy != "lpm" or self.cache is None \
                or not 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            return
        cache = self.cache

        def key(r: Req) -> tuple[int, int]:
            if r.pages or r.preempted:
                return (0, 0)
            # a look only: sorting must not make every queued prefix "recently used"
            return (1, -len(cache.match(r.prompt, self.pages.match_limit(r), touch=False)))

        self.waiting = deque(sorted(self.waiting, key=key))

    def flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache; refused while any request is in the server (SGLang's rule:
        their pages may be cached ones)."""
        if self.cache is None:
            return {"flushed": False, "message": "the prefix cache is disabled"}
        if self.reqs:
            raise RuntimeError(f"cannot flush the prefix cache: {len(self.reqs)} requests are "
                               f"in the server; retry when it is idle")
        return {"flushed": True, "freed_pages": self.cache.reset()}

    def _preempt(self, victim: Req) -> None:
        log.info("preempting %s (%d tokens) to free KV pages", victim.rid, victim.seq_len)
        self.running.remove(victim)
        self.pages.release(victim)
        victim.preempted = True
        self.counters.preempted += 1
        self.enqueue(victim, front=True)

    # ---- one step (pdcore.engine.loop.StepLoop: schedule -> run -> postprocess) -------------
    def schedule_decodes(self) -> list[Req]:
        """Every running request that needs one position gets its page, oldest first; when the
        pool runs out the newest running request is preempted."""
        decodes: list[Req] = []
        for req in sorted((r for r in self.running if r.remaining == 1), key=lambda r: r.arrival):
            if req not in self.running:
                continue  # preempted below as a victim
            while not self.pages.ensure(req, req.num_computed + 1):
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                if victim is req:
                    break
            if req in self.running:
                decodes.append(req)
        return decodes

    def draft_budgets(self, decodes: list[Req]) -> list[int]:
        """The draft tokens each decode may verify this step: its output and the context
        length each leave room for that many plus the target's own token."""
        return [min(r.params.max_new_tokens - len(r.output),
                    self.cfg.context_length - r.seq_len) - 1 for r in decodes]

    def with_draft_pages(self, decodes: list[Req]) -> list[tuple[Req, int]]:
        """The decode items with pages for this step's drafts (req.spec.drafts, cut to what the
        free pages hold: a queued request's next chunk keeps its pages)."""
        chunk = min(self.cfg.chunk_size, self.cfg.max_prefill_tokens)
        reserve = self.blocks.pages_for(chunk) if self.waiting else 0
        return [(req, 1 + self.pages.for_drafts(req, reserve)) for req in decodes]

    def schedule_prefills(self, items: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        """`items` (the decodes) plus the prefill budget spent on partly filled requests, then
        on waiting ones; a step with decodes spends at most cfg.decode_step_prefill. The
        partly filled ones go first, so a long prompt progresses every step."""
        budget = decode_step_budget(self, items)
        scheduled = {id(r) for r, _ in items}
        for req in [r for r in self.running if r.remaining > 1 and id(r) not in scheduled]:
            if budget <= 0:
                break
            n = min(req.remaining, budget)
            if self.pages.ensure(req, req.num_computed + n):
                items.append((req, n))
                budget -= n
        self._order_waiting()
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            n = self._admit(req, budget) if room_for_running(self, req, budget) else 0
            if not n:
                break
            self.waiting.popleft()
            req.phase = Phase.RUNNING
            self.running.append(req)
            items.append((req, n))
            budget -= n
        self.last_ran = bool(items)
        return items

    def count_step(self, kind: str, took: float, items: list[tuple[Req, int]]) -> None:
        """One forward's time by the step's kind (Counters.book; the auto budget's too)."""
        self.counters.book(kind, took)
        self.budget.observe(kind, took, items)

    def after_step(self, results: list[StepResult]) -> None:
        """The step's results are applied: the role extension sees them."""
        self.ext.after_step(results)

    def poll(self) -> bool:
        """The role extension advances its queues. True: tokens came without a forward pass
        (PD decode: the first token, computed by P) and go out now instead of after this
        step's forward, which would add a whole decode step to their TTFT; the forward runs
        on the next call (at once), and every other call at most flushes early, so arrivals
        cannot starve the running batch."""
        before = self.counters.generated_tokens
        self.ext.poll()
        if self.counters.generated_tokens != before and not self.flushed_early:
            self.flushed_early = self.last_ran = True
            return True
        self.flushed_early = False
        return False

    def refuse(self, rid: str, message: str, status: int, why: str | None = None) -> None:
        """A request that never entered: its one finished output goes out with the next ones."""
        self.outbox.append(TokenOut(rid, [], finished=True, error=message, error_status=status,
                                    finish_reason={"type": "abort", "message": why or message}))

    def live(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.phase is not Phase.FINISHED]

    def collect(self) -> list[TokenOut]:
        """Every request's new output (and the refusals); finished requests are forgotten."""
        out, self.outbox = self.outbox, []
        self.uncollected = False
        for req in list(self.reqs.values()):
            msg = take_output(req)
            if msg is not None:
                out.append(msg)
                if msg.finished:
                    del self.reqs[req.rid]
        return out

    def apply(self, res: StepResult) -> None:
        """One item's result of the step: its tokens appended and checked, its computed pages
        offered to the prefix cache (the step loop has booked a verify's drafts already)."""
        req = res.req
        if res.error is not None:  # this request alone failed in the step (model_runner)
            self.fail(req, *res.error)
            return
        if res.spec_tokens is not None:
            self._apply_verify(req, res)
            return
        req.num_computed += res.n
        if res.n > 1 or req.num_computed <= len(req.prompt):
            self.pages.cache(req, adopt=True)  # a prefill chunk: shared with later requests
        if res.prompt_logprobs:
            req.pending_in_logprobs.extend(res.prompt_logprobs)
        if res.token is None:
            return
        self.push_token(req, res.token, res.logprob)

    def _apply_verify(self, req: Req, res: StepResult) -> None:
        """Tokens of a verify pass: positions up to the last accepted draft hold valid K/V; the
        rejected drafts' pages beyond the sequence go back to the pool at once."""
        tokens = res.spec_tokens or []
        base = req.num_computed
        for i, tok in enumerate(tokens):
            req.num_computed = base + i + 1  # the token before this one is in the pool
            self.push_token(req, tok, res.spec_logprobs[i] if res.spec_logprobs else None,
                            last=i == len(tokens) - 1)
            if req.finish_reason is not None:  # finish() sets it, held by the role or not
                return
        self.pages.trim(req)

    def push_token(self, req: Req, token: int, logprob: Any = None,
                   last: bool = True) -> None:
        """Append an output token and apply the finish checks. `last`: the sampling state has
        seen no token after this one (a verify observes all its tokens before they are
        pushed: its grammar's end belongs to its last token)."""
        req.output.append(token)
        req.pending_tokens.append(token)
        if logprob is not None:
            req.pending_out_logprobs.append(logprob)
        self.counters.generated_tokens += 1
        p = req.params
        # a grammar that took a stop token ends the output, even with ignore_eos
        stopped = not p.ignore_eos and token in self.cfg.eos_ids or token in p.stop_token_ids
        if stopped or last and req.state.grammar_done:
            self.finish(req, {"type": "stop", "matched": token})
        elif len(req.output) >= p.max_new_tokens:
            self.finish(req, {"type": "length", "length": p.max_new_tokens})
        elif req.seq_len >= self.cfg.context_length:
            self.finish(req, {"type": "length", "length": len(req.output)})

    def finish(self, req: Req, reason: dict[str, Any], drop_ext: bool = True) -> None:
        req.finish_reason = reason
        if drop_ext and self.ext.on_finish(req):
            return  # the extension holds it (e.g. P waits for the KV transfer to finish)
        self.drop(req)

    def drop(self, req: Req) -> None:
        self.dropped.append(req)
        req.phase = Phase.FINISHED
        self.uncollected = True  # its final TokenOut goes out on the next step
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pages.release(req)
        self.counters.finished += 1

    def take_dropped(self) -> list[Req]:
        """The requests dropped since the last call (the step loop's speculator remembers the
        finished ones)."""
        out, self.dropped = self.dropped, []
        return out

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.outbox or self.uncollected
                    or self.ext.busy())


def decode_step_budget(sched: Scheduler, items: list[tuple[Req, int]]) -> int:
    """The prefill budget of a step: the chunk; with decodes (`items`), what
    --decode-step-prefill-tokens (N, -1 or auto: engine/sched/budget.py) allows."""
    chunk = min(sched.cfg.chunk_size, sched.cfg.max_prefill_tokens)
    if not items:
        return chunk
    waits = bool(sched.waiting) or any(r.remaining > 1 for r in sched.running)
    return min(chunk, sched.budget.for_step([r for r, _ in items], waits, sched.now()))


def room_for_running(sched: Scheduler, req: Req, budget: int) -> bool:
    """--schedule-conservativeness: whether admitting `req`'s next chunk still leaves the share
    of free pages kept back for the running requests' remaining outputs."""
    share = min(1.0, sched.cfg.conservativeness - 1.0)
    if share <= 0 or not sched.running:
        return True
    blocks = sched.blocks
    need = sum(blocks.pages_for(max(0, r.params.max_new_tokens - len(r.output)))
               for r in sched.running)
    return blocks.num_free - blocks.pages_for(min(req.remaining, budget)) >= share * need


class DecodeLog:
    """--decode-log-interval: one line every N decode steps (SGLang's decode batch line); the
    scheduler process calls `after_step` after each step."""

    def __init__(self, interval: int) -> None:
        self.interval, self.logged = interval, 0
        self.mark: tuple[float, int] | None = None

    def after_step(self, sched: Scheduler) -> None:
        c = sched.counters
        if c.decode_steps // self.interval == self.logged:
            return
        self.logged = c.decode_steps // self.interval
        now = time.perf_counter()
        rate = (c.generated_tokens / max(c.decode_seconds + c.extend_seconds, 1e-9)
                if self.mark is None
                else (c.generated_tokens - self.mark[1]) / max(now - self.mark[0], 1e-9))
        self.mark = (now, c.generated_tokens)
        log.info("decode batch: %d running, %d queued, KV pages %d/%d used, %.1f tokens/s",
                 len(sched.running), len(sched.waiting), sched.blocks.num_used,
                 sched.blocks.num_pages, rate)
