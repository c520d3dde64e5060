"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcore.messages.io import GenerateReq, LogprobEntry, PDRoute
from pdcore.engine.sched.sampler import SampleState


class Phase(enum.Enum):
    WAITING = "waiting"  # queued for (re)fill
    RUNNING = "running"  # has pages; being filled or decoded
    HELD = "held"  # owned by the role extension (PD: bootstrap / transfer / inflight queues)
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt: list[int]
    state: SampleState
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    route: PDRoute | None = None  # PD: read by the role extension only
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose K/V is in the pool
    cached_tokens: int = 0  # prompt positions taken from a prefix cache, not computed here
    phase: Phase = Phase.WAITING
    out_logprobs: list[LogprobEntry] = field(default_factory=list)
    in_logprobs: list[LogprobEntry] | None = None
    pending_in_logprobs: list[LogprobEntry] = field(default_factory=list)
    sent_prompt_stats: bool = False
    pending_tokens: list[int] = field(default_factory=list)  # not yet sent to the HTTP side
    pending_out_logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    error_status: int = 500
    error_code: str | None = None  # a named reason (pdcore.messages.codes.ErrorCode) or None
    preempted: bool = False
    first_token_at: float | None = None  # first decode step's start (engine/sched/budget.py)
    ctx_slots: torch.Tensor | None = None  # cached slot table for positions < num_computed
    disagg: Any = None  # the role extension's per-request state
    spec: Any = None  # speculative decoding: this request's drafting state (ReqSpec)

    @classmethod
    def from_generate(cls, g: GenerateReq, eos_ids: frozenset[int] = frozenset()) -> Req:
        return cls(
            rid=g.rid, prompt=list(g.input_ids),
            state=SampleState.create(g.sampling, g.input_ids, eos_ids, resumed=g.resumed,
                                     seed_skip=g.seed_skip),
            return_logprob=g.return_logprob, logprob_start_len=g.logprob_start_len,
            top_logprobs_num=g.top_logprobs_num, route=g.route,
        )

    @property
    def params(self):
        return self.state.params

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_at(self, pos: int) -> int:
        n = len(self.prompt)
        return self.prompt[pos] if pos < n else self.output[pos - n]

    @property
    def drafts(self) -> list[int]:
        """This step's draft tokens (speculative decoding); empty when it drafts none."""
        return self.spec.drafts if self.spec is not None else []

    @property
    def remaining(self) -> int:
        """Positions still to compute before the next token can be sampled."""
        return self.seq_len - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.preempted
