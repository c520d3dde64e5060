"""The hooks the scheduler calls on a role extension (PD prefill, PD decode, or a test's
stand-in), and what it may read of the model side (`ModelSide`). What an extension may call
back is pdcore.engine.sched.api.SchedulerAPI."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcore.engine.sched.request import Req
from pdcore.engine.sched.stats import StatsReport

if TYPE_CHECKING:
    import torch

    from pdcore.engine.sched.batch_run import StepResult


class Extension:
    """Hooks a role plugs into the scheduler (unified mode: all defaults)."""

    def admit(self, req: Req) -> bool:
        """Take ownership of a new request (True) or let it go to the waiting queue."""
        return False

    def poll(self) -> None:
        """Advance the extension's own queues."""

    def after_step(self, results: list[StepResult]) -> None:
        """See what the forward pass computed (send finished pages, ...)."""

    def on_finish(self, req: Req) -> bool:
        """A request reached its end. True: the extension keeps it (pages too) for now."""
        return False

    def on_abort(self, req: Req) -> None:
        """Release the extension's per-request state."""

    def implicated(self, error: Exception) -> list[Req]:
        """The requests an unexpected step error concerns (empty: it names none of them)."""
        return []

    def busy(self) -> bool:
        return False

    def stats(self) -> StatsReport:
        """The extension's part of the scheduler's report (engine/sched/stats.py)."""
        return StatsReport()

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class HeadChain:
    """What the scheduler's side knows of a draft head (EAGLE, EAGLE3, NEXTN, MTP) to hand
    over or adopt a chain start (engine/sched/eagle.py: ChainStart): the dtype and device of
    the head's output vectors and the drafts a request may hold. The head itself stays with
    the step loop's speculator and runs only through the model runner."""

    dtype: torch.dtype
    device: torch.device
    max_drafts: int


@dataclass(frozen=True)
class ModelSide:
    """What a role extension may read of the model side, handed to the scheduler at build
    (`Scheduler.side`; the scheduler itself never reads it): the KV pool's layers (a fork
    copies a prompt's pages), the target's sizes and, with a draft head, its chain's facts."""

    kv_layers: list[tuple[torch.Tensor, torch.Tensor]]
    hidden_size: int
    vocab_size: int
    chain: HeadChain | None = None
