"""What the process driving a scheduler (pdcore.runtime: the scheduler process's loop, the TP
lockstep, attaching the role extension; the engine's own close and DP attention's sync) may do
to it: hand it requests and aborts, step it and collect its outputs, fail what a step error
concerns, read the few numbers its loop decides on, attach and close the role extension. The
runtime holds one of these, never the scheduler's fields (its queues, config, runner, speculator,
extension), so the scheduler may reshape them freely; `tests/test_scheduler_seams.py` holds it.
What a role extension may do is the other half: pdcore.engine.sched.api.SchedulerAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdcore.engine.sched.extension import Extension
from pdcore.engine.sched.request import Phase, Req
from pdcore.engine.sched.stats import StatsReport
from pdcore.messages.io import GenerateReq, TokenOut

if TYPE_CHECKING:
    from pdcore.engine.loop import StepLoop
    from pdcore.engine.model.layers import TPInfo
    from pdcore.engine.sched.scheduler import DecodeLog, Scheduler


class RuntimeAPI:
    """What the runtime may do to the scheduler it drives."""

    def __init__(self, sched: Scheduler, loop: StepLoop | None = None) -> None:
        """`loop`: the engine step that owns `sched` (engine/loop.py), for what runs a step or
        reads the model side; without it only the scheduler's own calls work."""
        self._s, self._loop = sched, loop

    @property
    def _l(self) -> StepLoop:
        if self._loop is None:
            raise RuntimeError("this RuntimeAPI was made without the engine's step loop")
        return self._loop

    # ---- requests -------------------------------------------------------------------------
    def submit(self, msg: GenerateReq) -> None:
        """A request from the HTTP process enters (validated; a bad one is refused with 400)."""
        s = self._s
        s.add(Req.from_generate(msg, s.cfg.eos_ids))

    def abort(self, rid: str, reason: str = "aborted") -> None:
        self._s.abort(rid, reason)

    def refuse(self, rid: str, message: str, status: int, why: str | None = None) -> None:
        """A request that never entered: its one finished output goes out with the next ones."""
        self._s.refuse(rid, message, status, why)

    def find(self, rid: str) -> Req | None:
        return self._s.reqs.get(rid)

    def live(self) -> list[Req]:
        return self._s.live()

    def fail(self, req: Req, message: str, status: int = 500) -> None:
        self._s.fail(req, message, status)

    def drop_failed(self, req: Req, message: str, status: int = 500) -> None:
        """The last resort when failing `req` raised (its role extension's abort hook broke): it
        ends with `message` without the extension, its pages freed, unless it ended already."""
        req.error, req.error_status = message, status
        req.finish_reason = {"type": "abort", "message": message}
        if req.phase is not Phase.FINISHED:
            self._s.drop(req)

    def implicated(self, error: Exception) -> list[Req]:
        """The live requests an unexpected step error concerns, as the role extension names
        them (a TransferError's room); empty: it names none."""
        live = self._s.live()
        return [r for r in self._s.ext.implicated(error) if r in live]

    # ---- stepping -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self._s.has_work()

    def step(self) -> list[TokenOut]:
        """One engine step: schedule -> run -> postprocess -> collect (StepLoop.step)."""
        return self._l.step()

    def collect(self) -> list[TokenOut]:
        return self._s.collect()

    def step_due(self) -> bool:
        """The next step should run without waiting for messages: the last one did work, or
        outputs are waiting to go out."""
        return bool(self._s.last_ran or self._s.outbox)

    def set_clock(self, now: float) -> None:
        """The next step's time (rank 0's clock, the same on every TP rank)."""
        self._s.step_time = now

    @property
    def spec_ratio(self) -> float | None:
        """Speculative decoding's measured verify/decode cost ratio (None: no speculation)."""
        spec = self._l.spec
        return spec.ratio if spec is not None else None

    @spec_ratio.setter
    def spec_ratio(self, ratio: float | None) -> None:
        """Every TP rank gates its drafts on rank 0's ratio."""
        if ratio is not None and self._l.spec is not None:
            self._l.spec.ratio = ratio

    @property
    def budget_est(self) -> tuple[float | None, float | None] | None:
        """The auto prefill budget's step cost estimates (None: a fixed budget)."""
        return self._s.budget.estimates()

    @budget_est.setter
    def budget_est(self, est: tuple[float | None, float | None] | None) -> None:
        """Every TP rank budgets on rank 0's estimates, so all schedule the same step."""
        self._s.budget.adopt(est)

    @property
    def tp_group(self) -> TPInfo:
        """The TP group whose ranks run this scheduler in lockstep."""
        return self._s.tp

    @property
    def num_running(self) -> int:
        return len(self._s.running)

    @property
    def num_waiting(self) -> int:
        return len(self._s.waiting)

    def log_decode(self, decode_log: DecodeLog) -> None:
        """--decode-log-interval: the decode batch line, when this step completed an interval."""
        decode_log.after_step(self._s)

    def pages_at_rest(self) -> bool:
        """Every KV page is free or held by the prefix cache alone, none by a request (live or
        gone): what the pool of a scheduler without requests must look like."""
        s = self._s
        cached = s.cache.num_pages if s.cache is not None else 0
        evictable = s.cache.evictable() if s.cache is not None else 0
        return s.blocks.num_free + cached == s.blocks.num_pages and evictable == cached

    def stats(self) -> StatsReport:
        """The engine's report: the scheduler's, the model side's and the speculator's."""
        return self._l.stats()

    def flush_cache(self) -> dict[str, Any]:
        return self._s.flush_cache()

    # ---- the role extension ---------------------------------------------------------------
    def attach_role(self, ext: Extension) -> None:
        """Install the role extension (PD prefill or decode); done once, before any request."""
        self._s.ext = ext

    def close_role(self) -> None:
        """Stop the role extension (its KV manager, threads, sockets)."""
        self._s.ext.close()

    # ---- the model side the process manages -----------------------------------------------
    @property
    def grammar_backend(self) -> Any:
        """The grammar backend constrained requests compile with (None: none)."""
        return getattr(self._l.runner, "grammar", None)

    def release_caches(self, give_back: bool = True) -> None:
        """Going idle: give back the buffers the steps grew (pinned/scratch tensors); with
        `give_back`, the free KV pages too (else `give_back_free`, later)."""
        self._l.release_caches(give_back)

    def give_back_free(self, idle_s: float) -> int:
        """Idle `idle_s` seconds: hand the free KV pages back to the kernel (their bytes)."""
        return self._l.give_back_free(idle_s)

    @property
    def model(self) -> Any:
        """The target model the steps run (DP attention counts its MoE layers)."""
        return self._l.runner.model

    @property
    def draft_dp_pads(self) -> Any:
        """DP attention: the draft head's padded passes per step (None: no draft head)."""
        drafter = getattr(self._l.spec, "drafter", None)
        return getattr(drafter, "dp_pads", None)
