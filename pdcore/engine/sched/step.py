"""The run stage of an engine step (schedule -> run -> postprocess, docs/architecture.md): the
target's forward through the one model runner, the draft head's passes around it, and the
step's time booked by its kind (prefill, verify, decode)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcore.engine.sched.batch_run import BatchRunner, StepResult
    from pdcore.engine.sched.request import Req
    from pdcore.engine.sched.speculative import Speculator
    from pdcore.engine.sched.stats import Counters


def run_stage(runner: BatchRunner, spec: Speculator | None, c: Counters,
              items: list[tuple[Req, int]]) -> list[StepResult]:
    """Forward `items` (sampled, verified) and let the draft head observe them, before the
    scheduler applies the results."""
    c.steps += 1
    t0 = time.perf_counter()
    if spec is not None:
        spec.before_forward()
    results = runner.run(items)
    if spec is not None:  # a draft model reads the step before it is applied
        spec.observe(items, results)
    book(c, spec, items, time.perf_counter() - t0)
    return results


def book(c: Counters, spec: Speculator | None, items: list[tuple[Req, int]],
         took: float) -> None:
    """The step's time by kind: a step with a prefill chunk is an extend step; else one that
    verified drafts a verify step (the speculator's cost gate learns from both kinds)."""
    if any(n > 1 and not r.drafts for r, n in items):
        c.extend_steps, c.extend_seconds = c.extend_steps + 1, c.extend_seconds + took
    elif spec is not None and any(r.drafts for r, _ in items):
        spec.steps, spec.seconds = spec.steps + 1, spec.seconds + took
        spec.timed(len(items), took, verify=True)
    else:
        c.decode_steps, c.decode_seconds = c.decode_steps + 1, c.decode_seconds + took
        if spec is not None:
            spec.timed(len(items), took, verify=False)
