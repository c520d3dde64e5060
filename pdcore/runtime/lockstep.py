"""The lockstep that keeps every TP rank's scheduler identical.

Rank 0 talks to the HTTP process; each loop it broadcasts a StepHeader (new requests, aborts,
whether to step, its clock) and every rank applies it and runs the same step. Inside a step
rank 0 samples and broadcasts the tokens (model_runner) and a role extension agrees on its
per-request states over the group (the PD extensions: pdcore.disagg.agree), so the schedules
never diverge. A request that fails inside a step fails alone (model_runner reports it to every
rank). An unexpected error out of a step with TP 1 fails the requests the role extension says
it concerns (a TransferError's room) or else every in-flight request, and the engine keeps
serving; with TP > 1 it is fatal, since the ranks could no longer be known to agree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdcore.messages.io import AbortReq, GenerateReq, TokenOut
from pdcore.errors import InvalidRequestError
from pdcore.runtime_env import trim_heap

if TYPE_CHECKING:
    from pdcore.engine.build import Engine
    from pdcore.engine.model.layers import TPInfo
    from pdcore.engine.sched.runtime_api import RuntimeAPI

log = logging.getLogger(__name__)


@dataclass
class StepHeader:
    """What rank 0 tells the other ranks before each loop iteration."""

    msgs: list[Any] = field(default_factory=list)  # GenerateReq / AbortReq, in arrival order
    run: bool = False  # run one scheduler step after applying msgs
    stop: bool = False
    now: float = 0.0  # rank 0's monotonic clock: time-based decisions must agree
    idle: bool = False  # DP attention: another DP rank steps, so this one runs an idle forward
    # speculative decoding's measured verify/decode cost ratio: every rank gates drafts on
    # rank 0's value (engine/sched/speculative.py)
    spec_ratio: float | None = None
    # rank 0 went idle (before this header): drop the decode K/V view, trim the heap
    going_idle: bool = False
    # rank 0 had been idle this many seconds and handed its free KV pages back: do the same
    # (engine/kv/giveback.py; each rank advises its own pool); None: not now
    give_back_s: float | None = None
    # --decode-step-prefill-tokens auto: rank 0's step cost estimates (engine/sched/budget.py)
    budget_est: tuple[float | None, float | None] | None = None


class Lockstep:
    """Drives one scheduler identically on every rank (rank 0 leads, the others follow)."""

    def __init__(self, engine: Engine) -> None:
        from pdcore.engine.sched.runtime_api import RuntimeAPI

        # the scheduler's public surface and the engine step (engine/loop.py), no fields
        self.sched: RuntimeAPI = RuntimeAPI(engine.scheduler, engine.loop)
        self.tp: TPInfo = self.sched.tp_group
        from pdcore.engine.parallel.dp_attention import sync_for

        # --enable-dp-attention: the DP ranks step together (pdcore.engine.parallel.dp_attention)
        self.dp = sync_for(self.tp, self.sched)
        self.stopped = False  # DP attention: a stop agreed with the other DP ranks
        self.peers_busy = False  # DP attention: some DP rank ran at the last agreement
        # rank 0's releases since the last header (`go_idle`, `give_back`), for the others
        self._going_idle, self._give_back_s = False, None

    def go_idle(self) -> None:
        """Rank 0 went idle: drop what only a running batch uses (the free KV pages stay for
        `give_back`) and trim the heap; the other ranks do the same at the next header."""
        self._going_idle = True
        _release(self.sched)

    def give_back(self, idle_s: float) -> int:
        """Rank 0 has been idle `idle_s` seconds: hand its free KV pages back to the kernel;
        the other ranks do the same at the next header. Returns rank 0's bytes."""
        self._give_back_s = idle_s
        return self.sched.give_back_free(idle_s)

    def _apply(self, msgs: list[Any]) -> None:
        # a decode server's parallel samples come inside sample 0's message (`forks`): they
        # enter right after it, in this same step, so they are parked on it before its KV
        for m in (x for msg in msgs for x in (msg, *getattr(msg, "forks", ()))):
            try:
                if isinstance(m, GenerateReq):
                    self.sched.submit(m)
                elif isinstance(m, AbortReq):
                    self.sched.abort(m.rid, m.reason)
            except Exception as e:
                # every rank applies the same messages, so every rank takes this branch alike;
                # a bad field found only here (a seed torch refuses) is the client's: 400
                bad = isinstance(e, InvalidRequestError)
                if bad:
                    log.warning("request %s refused: %s", m.rid, e)
                else:
                    log.exception("request %s could not be admitted", m.rid)
                req = self.sched.find(m.rid)
                if req is None:
                    self.sched.refuse(m.rid, str(e) if bad else f"{type(e).__name__}: {e}",
                                      400 if bad else 500, why=str(e))
                else:
                    self._contain_one(req, e)

    def lead(self, msgs: list[Any], stop: bool = False) -> list[TokenOut]:
        """Rank 0: apply msgs, tell the others, step if there is work; returns the outputs."""
        if self.stopped:
            return []
        self._apply(msgs)
        run = not stop and self.sched.has_work()
        idle = False
        if self.dp is not None:
            self.peers_busy, any_stop = self.dp.agree(run, stop)
            if any_stop:
                stop, run, self.stopped = True, False, True
            idle = self.peers_busy and not run
        now = time.monotonic()
        if self.tp.size > 1:
            self.tp.broadcast_object(StepHeader(msgs, run, stop, now, idle,
                                                self.sched.spec_ratio, self._going_idle,
                                                self._give_back_s, self.sched.budget_est))
        self._going_idle, self._give_back_s = False, None
        self.sched.set_clock(now)
        if not run:
            if idle:
                self.dp.idle_forward()  # type: ignore[union-attr]
            return []
        try:
            return self._step()
        except Exception as e:
            if self.tp.size > 1 or self.dp is not None:
                log.critical("scheduler step failed with TP %d; the ranks may disagree now, "
                             "so the engine stops", self.tp.size)
                raise
            return self._contain(e)

    def _step(self) -> list[TokenOut]:
        if self.dp is None:
            return self.sched.step()
        self.dp.begin()
        outs = self.sched.step()
        self.dp.end()
        return outs

    def _contain(self, e: Exception) -> list[TokenOut]:
        """Fail the requests an unexpected step error concerns; the loop goes on."""
        named = self.sched.implicated(e)
        victims = named or self.sched.live()
        log.exception("scheduler step failed (%s); failing %d request(s), the engine goes on",
                      f"room {getattr(e, 'room', None)}" if named
                      else "not attributable to one request", len(victims))
        for req in victims:
            self._contain_one(req, e)
        return self.sched.collect()

    def _contain_one(self, req: Any, e: Exception) -> None:
        why = f"internal error while serving this request: {type(e).__name__}: {e}"
        try:
            self.sched.fail(req, why, 500)
        except Exception:
            log.exception("failing request %s raised; dropping it", req.rid)
            self.sched.drop_failed(req, why, 500)

    def follow(self) -> bool:
        """Other ranks: one iteration as rank 0 decided; False once told to stop."""
        head: StepHeader = self.tp.broadcast_object(None)
        if head.going_idle:  # in rank 0's order: its releases came before these messages
            _release(self.sched)
        if head.give_back_s is not None:
            self.sched.give_back_free(head.give_back_s)
        self._apply(head.msgs)
        if head.stop:
            return False
        if head.run:
            self.sched.set_clock(head.now)
            self.sched.spec_ratio = head.spec_ratio  # kept when None (no speculation on rank 0)
            self.sched.budget_est = head.budget_est
            self._step()  # outputs are rank 0's business
        elif head.idle:
            self.dp.idle_forward()  # type: ignore[union-attr]
        return True


def _release(sched: RuntimeAPI) -> None:
    """Going idle, on every rank: the decode K/V view goes, and what the steps freed on the
    heap goes back to the OS (the free KV pages wait for the give-back)."""
    sched.release_caches(give_back=False)
    trim_heap()
