"""Requests and outputs between the HTTP process (tokenizer manager) and the scheduler process.

Sent pickled over pyzmq IPC sockets (PUSH -> PULL, one socket each way). Plain dataclasses so
both processes share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output (pdcore.constrained): kind is json_schema, json_object,
    regex, ebnf or structural_tag; source its text ("" for json_object); field the request
    field that named it, for error messages."""

    kind: str
    source: str
    field: str = "json_schema"


@dataclass(frozen=True)
class Bounds:
    """The range a numeric sampling field must lie in (checked once, at the HTTP edge, by
    server/params.build_sampling): lo / hi inclusive unless lo_open; None is unbounded."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def holds(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or v <= self.hi

    def text(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


def _sf(default: Any = None, bounds: Bounds | None = None, preferable: bool = True,
        factory: Any = None) -> Any:
    """One sampling field's declaration beyond name, type and default: its `bounds`, and
    whether --preferred-sampling-params may set it (`preferable`)."""
    meta = {"bounds": bounds, "preferable": preferable}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SamplingParams:
    """The one declaration of the sampling fields (name, type, default, bounds): the wire
    schemas (edge/schemas.py) name the same fields, checked by tests/server/
    test_sampling_params.py; build_sampling checks the bounds."""

    max_new_tokens: int = _sf(128, Bounds(0))
    temperature: float = _sf(1.0, Bounds(0))
    top_k: int = _sf(-1)  # -1 = off, else >= 1 (checked by build_sampling)
    top_p: float = _sf(1.0, Bounds(0, 1, lo_open=True))
    min_p: float = _sf(0.0, Bounds(0, 1))
    repetition_penalty: float = _sf(1.0, Bounds(0, lo_open=True))
    frequency_penalty: float = _sf(0.0, Bounds(-2, 2))
    presence_penalty: float = _sf(0.0, Bounds(-2, 2))
    seed: int | None = _sf(None, preferable=False)
    stop: list[str] = _sf(factory=list)  # handled by the HTTP process
    stop_token_ids: list[int] = _sf(factory=list)
    ignore_eos: bool = _sf(False)
    skip_special_tokens: bool = _sf(True)
    no_stop_trim: bool = _sf(False)
    # token id -> added to its logit
    logit_bias: dict[int, float] = _sf(factory=dict, preferable=False)
    # EOS and stop_token_ids cannot be sampled before this many tokens
    min_new_tokens: int = _sf(0, Bounds(0))
    # the output follows it (structured output)
    grammar: GrammarSpec | None = _sf(None, preferable=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1


@dataclass(frozen=True)
class PDRoute:
    """A PD request's route as the HTTP edge checked it (signed by the router or naming a
    trusted prefill address): the room its KV fills (P) or comes from (D), where P's bootstrap
    server is, which prefill DP rank holds it, and for a parallel sample on D the sample whose
    received prompt pages it forks. The engine carries it unread; only the role extensions
    (disagg/prefill/sched.py, disagg/decode/sched.py) read it."""

    host: str | None = None
    port: int | None = None
    room: int | None = None
    prefill_dp_rank: int | None = None  # None: room % P's DP size
    fork_of: str | None = None  # PD decode, n > 1: the rid of sample 0 of the same prompt


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs; k: prompt logprobs from position k
    top_logprobs_num: int = 0
    stream: bool = False
    route: PDRoute | None = None  # PD only: opaque to the engine
    arrival_time: float = 0.0
    # --dp-size > 1: the replica asked for (`data_parallel_rank`); None lets the balancer pick
    routed_dp_rank: int | None = None
    # migration (the router resumes a broken stream elsewhere, router/migrate.py): the
    # prompt's last `resumed` tokens are output an earlier leg already streamed; the sampler
    # observes them (penalties, min_new_tokens, grammar) and a seeded generator skips
    # `seed_skip` draws, so the continuation draws what the undisturbed run would have
    resumed: int = 0
    seed_skip: int = 0
    # PD decode, n > 1: samples 1..n-1 of this prompt (each with `route.fork_of` = this rid)
    # travel in this message, so the scheduler parks them on it at once, whatever the timing
    forks: list[GenerateReq] = field(default_factory=list)


@dataclass
class AbortReq:
    rid: str
    reason: str = "aborted by client"


class ControlKind(StrEnum):
    """The control calls the HTTP process makes of the scheduler (a str: the value is its name
    on the wire and in logs)."""

    FLUSH_CACHE = "flush_cache"  # -> {"flushed": bool, ...}; refused while requests run
    GET_LOAD = "get_load"  # -> the StatsReport as /get_load's JSON (StatsReport.as_dict)
    STATS = "stats"  # -> the StatsReport itself (messages/stats.py)
    START_PROFILE = "start_profile"  # args: output_dir -> {"output_dir"}
    STOP_PROFILE = "stop_profile"  # -> {"stopped": True}


@dataclass
class ControlReq:
    """A request/response call; the scheduler answers with ControlResp carrying the same
    `call_id`."""

    call_id: str
    kind: ControlKind
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlResp:
    """`data`: the call's answer; for STATS the scheduler's StatsReport
    (messages/stats.py), turned into JSON or Prometheus series only at the HTTP edge."""

    call_id: str
    ok: bool
    data: Any = field(default_factory=dict)
    error: str = ""


# One logprob entry: (logprob, token_id, top) where top is [(logprob, token_id), ...] or None.
LogprobEntry = tuple[float, int, list[tuple[float, int]] | None]


@dataclass
class TokenOut:
    """Incremental output of one request. The first message of a request carries prompt
    statistics; `finished` marks the last one."""

    rid: str
    new_token_ids: list[int]
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] | None = None  # prompt logprobs, sent once
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    finish_reason: dict[str, Any] | None = None  # {"type": "length"|"stop"|"abort", ...}
    error: str | None = None  # set when the request failed (transfer failure, ...)
    error_status: int = 500
    error_code: str | None = None  # the failure's named reason (messages/codes.ErrorCode)
    spec_verify_ct: int = 0  # verify passes of speculative decoding (on the last message)
