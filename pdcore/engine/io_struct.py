"""Messages between the HTTP process (tokenizer manager) and the scheduler process.

Sent pickled over pyzmq IPC sockets (PUSH -> PULL, one socket each way). Plain dataclasses so
both processes share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output (pdcore.engine.sched.grammar): kind is json_schema, json_object,
    regex, ebnf or structural_tag; source its text ("" for json_object); field the request
    field that named it, for error messages."""

    kind: str
    source: str
    field: str = "json_schema"


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # handled by the HTTP process
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_new_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    grammar: GrammarSpec | None = None  # the output follows it (structured output)

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


@dataclass
class AbortReq:
    rid: str
    reason: str = "aborted by client"


@dataclass
class ControlReq:
    """Request/response calls: kind in {"flush_cache", "get_load", "stats", "start_profile",
    "stop_profile"}; the scheduler answers with ControlResp carrying the same `call_id`."""

    call_id: str
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlResp:
    """`data`: the call's answer; for "stats" the scheduler's StatsReport
    (engine/sched/stats.py), turned into JSON or Prometheus series only at the HTTP edge."""

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
    spec_verify_ct: int = 0  # verify passes of speculative decoding (on the last message)
