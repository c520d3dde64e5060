"""The engine step: schedule -> run (target and drafts) -> postprocess, then collect.

`StepLoop` owns the engine's two halves and is the one place that joins them:
- the scheduler (`engine/sched/scheduler.py`): queues, pages, finish checks; it decides what
  runs and applies what came out, and never runs a model;
- the runner (`engine/sched/batch_run.py` over `engine/model/runner.py`): packs the items,
  runs the target's forward, samples and verifies;
- the speculator (`engine/sched/speculative.py`, None without speculative decoding): it plugs
  in here alone: drafts for the decode batch between the decodes' and the prefills' share of
  the schedule (a draft head's chain passes run then, through the same model runner), its
  head's observe after the forward, its verify bookkeeping before the scheduler applies a
  verify's tokens, and finished requests for its n-gram cache.

One step (`step`):
1. poll: the role extension advances its queues; tokens it brought from elsewhere (PD decode's
   first token) go out at once and the forward waits for the next call;
2. schedule: the decodes get their next page, the speculator drafts for them (their pages from
   free pages only), the prefill budget goes to partial and waiting requests;
3. run: one packed forward through the runner, the draft head observing it; the step's time
   booked by kind (the speculator's cost gate learns from it);
4. postprocess: the scheduler appends tokens, checks finishes, caches computed pages and frees
   rejected drafts' pages; the role extension sees the results; then every request's new
   output is collected.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdcore.engine.sched.stats import StatsReport, scheduler_stats

if TYPE_CHECKING:
    from pdcore.messages.io import TokenOut
    from pdcore.engine.sched.batch_run import BatchRunner, StepResult
    from pdcore.engine.sched.request import Req
    from pdcore.engine.sched.scheduler import Scheduler
    from pdcore.engine.sched.speculative import Speculator


class StepLoop:
    """The scheduler, the runner and the speculator, joined by `step` (module docstring)."""

    def __init__(self, sched: Scheduler, runner: BatchRunner,
                 spec: Speculator | None = None) -> None:
        self.sched, self.runner, self.spec = sched, runner, spec

    def step(self) -> list[TokenOut]:
        s = self.sched
        if s.poll():
            return self.collect()
        self._finished()  # before drafting: what poll and the last messages finished
        items = self.schedule()
        if items:
            results = self.run(items)
            self.postprocess(results)
        return self.collect()

    def schedule(self) -> list[tuple[Req, int]]:
        """This step's (request, positions) items: decodes (with their drafts), then prefill."""
        s = self.sched
        decodes = s.schedule_decodes()
        if self.spec is None:
            items = [(r, 1) for r in decodes]
        else:
            self.spec.propose_all(decodes, s.draft_budgets(decodes))
            self.spec.select(decodes)
            items = s.with_draft_pages(decodes)
        return s.schedule_prefills(items)

    def run(self, items: list[tuple[Req, int]]) -> list[StepResult]:
        """The target's forward of `items` (sampled, verified), which the draft head observes
        before the results are applied."""
        spec = self.spec
        t0 = time.perf_counter()
        if spec is not None:
            spec.before_forward()
        results = self.runner.run(items)
        if spec is not None:  # a draft model reads the step before it is applied
            spec.observe(items, results)
        took = time.perf_counter() - t0
        kind = step_kind(items, spec)
        self.sched.count_step(kind, took, items)
        if spec is not None and kind != "extend":
            spec.timed(len(items), took, verify=kind == "verify")
        return results

    def postprocess(self, results: list[StepResult]) -> None:
        s, spec = self.sched, self.spec
        for res in results:
            req = res.req
            if spec is not None and res.error is None and res.spec_tokens is not None:
                spec.verified(req, req.drafts, res.spec_tokens)
                req.spec.drafts = []  # type: ignore[union-attr]
            s.apply(res)
        s.after_step(results)

    def collect(self) -> list[TokenOut]:
        out = self.sched.collect()
        self._finished()
        return out

    def _finished(self) -> None:
        """Requests the scheduler dropped since the last look: those that finished without an
        error enter the speculator's memory (NGRAM's cross-request cache)."""
        done = self.sched.take_dropped()
        if self.spec is not None:
            for req in done:
                if req.error is None:
                    self.spec.remember(req)

    def release_caches(self, give_back: bool = True) -> None:
        """Going idle: drop what only a running batch uses (the decode K/V view); with
        `give_back`, hand the free KV pages back to the kernel now too."""
        self.runner.release_caches(give_back)

    def give_back_free(self, idle_s: float) -> int:
        """Idle `idle_s` seconds: hand the free KV pages back (engine/kv/giveback.py)."""
        return self.runner.model_runner.give_back_free(idle_s)

    def stats(self) -> StatsReport:
        """The engine's report (/get_load, /metrics): the scheduler's, the model side's
        (native kernels, grammars) and the speculator's."""
        return scheduler_stats(self.sched, self.runner, self.spec)


def step_kind(items: list[tuple[Req, int]], spec: Speculator | None) -> str:
    """A step with a prefill chunk is an extend step; else one that verified drafts a verify
    step, else a decode step (the speculator's cost gate learns from the last two)."""
    if any(n > 1 and not r.drafts for r, n in items):
        return "extend"
    if spec is not None and any(r.drafts for r, _ in items):
        return "verify"
    return "decode"
