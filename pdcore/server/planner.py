"""The one request planner: what a route parsed (PlanInput) -> the scheduler items (Plan).

Every route (/v1/chat/completions, /v1/completions, /v1/responses, /generate) reads its own
wire shape into a PlanInput and calls `plan`; everything after that is one code path: prompt
checks, the sampling options (build_sampling), max_new_tokens (`max_new_tokens` decides it,
`_limit` writes it: the one place in pdcore), seeds of parallel samples, request ids, PD routes
and the items. The requests a server makes itself (the start-up warm-up, /health_generate) are
planned here too (`plan_probe`), so a prefill server's "one token" is decided here for every
request its engine receives; P's scheduler only refuses a request planned otherwise.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pdcore.messages.info import EngineInfo
from pdcore.messages.io import GenerateReq, SamplingParams
from pdcore.route_auth import RequestGuard, RouteGuard
from pdcore.runtime import EngineHandle, new_rid
from pdcore.server.generation import Item
from pdcore.server.params import (
    SAMPLING_FIELDS,
    PDInfo,
    bad,
    build_sampling,
    check_prompt,
    make_req,
    pd_items,
    preferred_sampling,
    sample_item,
)


@dataclass
class PromptInput:
    """One prompt and what its samples ask for."""

    ids: list[int]
    field: str  # the field it came from, named in errors ("messages", "text[1]")
    sampling: dict[str, Any]  # SamplingParams field -> what the client sent (None: absent)
    max_tokens: int | None = None  # the client's cap on new tokens (None: not given)
    n: int = 1
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


@dataclass
class PlanInput:
    """What a route parsed from its request, the planner's one input."""

    prompts: list[PromptInput]
    route_fields: Any  # the body: bootstrap_host/port/room/sig, routed_dp_rank (params.pd_items)
    rid: str | list[str] | None = None
    stream: bool = False
    max_tokens_field: str = "max_new_tokens"  # the field max_tokens came from, for errors
    default_max: int | None = None  # max_new_tokens when none is given (None: the room left)
    field_prefix: str = ""  # "sampling_params." on /generate
    model_defaults: bool = False  # fill absent fields from the model's generation config
    id_prefix: str | None = None  # OpenAI ids ("chatcmpl-..."); None on /generate
    batch: bool = False  # /generate answers a list


@dataclass
class Plan:
    items: list[Item]
    prompts: list[list[int]]
    n: int
    rid: str
    return_logprob: list[bool] = field(default_factory=list)  # per item
    top_logprobs_num: list[int] = field(default_factory=list)  # per item
    # set by the OpenAI routes
    model: str = ""
    want_logprobs: bool = False
    top_logprobs: int = 0
    echo_texts: list[str] = field(default_factory=list)
    batch: bool = False  # set by /generate: the answer is a list


def sampling_fields(body: Any) -> dict[str, Any]:
    """The SamplingParams fields a request schema declares under the same name, as sent."""
    declared = getattr(type(body), "model_fields", {})
    return {f: getattr(body, f) for f in SAMPLING_FIELDS - {"max_new_tokens", "grammar"}
            if f in declared}


def max_new_tokens(requested: int | None, name: str, prompt_len: int, info: EngineInfo,
                   default: int | None, mode: str) -> int:
    """The one place a request's max_new_tokens is decided: what the client asked (OpenAI's
    max_tokens / max_completion_tokens / max_output_tokens or SGLang's max_new_tokens, `name`
    says which), else `default`, else all the room left; clamped to the room left in the
    context and in the KV pool. A prefill server makes one token whatever was asked. 0 is
    allowed: the scheduler then makes one token that the answer discards (Item.discard)."""
    if requested is not None and requested < 0:
        raise bad(f"{name} must be >= 0, got {requested}", name)
    room = 1 << 30
    for limit in (info.context_length, info.max_total_tokens):
        if limit:
            room = min(room, limit - prompt_len)
    if mode == "prefill":
        return 1
    if requested is None:
        requested = room if default is None else default
    return max(0, min(requested, room))


def _limit(sampling: SamplingParams, limit: int) -> SamplingParams:
    """The one statement in pdcore that sets a request's max_new_tokens (tests/test_one_planner.py
    holds it): the decided `limit`, at least 1 (0 asks for prompt logprobs only: the scheduler
    makes one token that the answer discards)."""
    sampling.max_new_tokens = max(1, limit)
    return sampling


def plan_probe(rid: str, ids: list[int], engine: EngineHandle, pd: PDInfo) -> GenerateReq:
    """A request the server makes itself (the start-up warm-up, /health_generate): one greedy
    token whatever the stop conditions, its max_new_tokens decided as a client's is."""
    limit = max_new_tokens(1, "max_new_tokens", len(ids), engine.info, None,
                           engine.args.disaggregation_mode)
    return make_req(rid, ids, _limit(SamplingParams(temperature=0.0, ignore_eos=True), limit), pd)


def _rid(inp: PlanInput, plan_rid: str, k: int, total: int) -> str:
    """Item k's request id: the client's (one per item, or one for a single item), else on
    the OpenAI routes a single item is the response's id; a /generate batch under one rid
    names its entries rid_k."""
    if isinstance(inp.rid, list):
        return inp.rid[k]
    if total == 1 and (inp.rid is not None or inp.id_prefix is not None):
        return plan_rid
    if isinstance(inp.rid, str) and inp.id_prefix is None:
        return f"{inp.rid}_{k}"
    return new_rid()


def plan(inp: PlanInput, engine: EngineHandle, guard: RouteGuard | RequestGuard) -> Plan:
    args, info = engine.args, engine.info
    for p in inp.prompts:
        check_prompt(p.ids, info, p.field, args.allow_auto_truncate)
    pds = pd_items(inp.route_fields, [p.n for p in inp.prompts], args, guard)
    total = sum(p.n for p in inp.prompts)
    if isinstance(inp.rid, list) and len(inp.rid) != total:
        noun = "requests" if inp.id_prefix is None else "choices"
        raise bad(f"rid has {len(inp.rid)} entries for {total} {noun}", "rid")
    rid = inp.rid if isinstance(inp.rid, str) else \
        f"{inp.id_prefix or 'gen'}-{uuid.uuid4().hex}"
    model_defaults = info.sampling_defaults if inp.model_defaults else {}
    preferred = preferred_sampling(args.preferred_sampling_params)
    mode = args.disaggregation_mode
    resume = _resume_ids(inp, info)
    items: list[Item] = []
    per_item: list[PromptInput] = []
    for p, prompt in enumerate(inp.prompts):
        given = dict(prompt.sampling)
        for name, value in model_defaults.items():
            if given.get(name) is None:  # --sampling-defaults model: the model's own values
                given[name] = value
        limit = max_new_tokens(prompt.max_tokens, inp.field_prefix + inp.max_tokens_field,
                               len(prompt.ids), info,
                               preferred.get("max_new_tokens", inp.default_max), mode)
        ids = prompt.ids
        if resume is not None:
            limit, ids = _resumed_limit(limit, resume, mode), ids + resume
        leader: Item | None = None
        for j in range(prompt.n):
            sampling = _limit(build_sampling(given, inp.field_prefix, defaults=preferred),
                              limit)
            if sampling.seed is not None and j:
                sampling.seed += j  # n samples with one seed must still differ
            want = prompt.return_logprob
            req = make_req(_rid(inp, rid, len(items), total), ids, sampling, pds[p],
                           return_logprob=want,
                           logprob_start_len=prompt.logprob_start_len if want else -1,
                           top_logprobs_num=prompt.top_logprobs_num, stream=inp.stream)
            item = sample_item(len(items), req, leader, mode)
            item.discard = limit == 0
            if resume:
                # token k (k >= 1) of a PD request is drawn with the seed's k-th uniform (P draws
                # token 0 with the first); P now draws token N, D from token N + 1
                req.resumed, item.resumed = len(resume), list(resume)
                req.seed_skip = len(resume) - 1 if mode == "prefill" else len(resume)
            items.append(item)
            per_item.append(prompt)
            leader = leader or item
    return Plan(items, [p.ids for p in inp.prompts], inp.prompts[0].n if inp.prompts else 1,
                rid, [p.return_logprob for p in per_item],
                [p.top_logprobs_num for p in per_item], batch=inp.batch)


RESUME_FIELD = "pd_resume_ids"


def _resume_ids(inp: PlanInput, info: EngineInfo) -> list[int] | None:
    """A migrated request's output so far (the router's `pd_resume_ids`), checked: one prompt,
    one sample, token ids in the vocabulary, prompt and output within the context."""
    ids = getattr(inp.route_fields, RESUME_FIELD, None)
    if ids is None:
        return None
    if len(inp.prompts) != 1 or inp.prompts[0].n != 1:
        raise bad(f"{RESUME_FIELD} continues one output: give one prompt and n = 1", RESUME_FIELD)
    if ids:
        check_prompt(inp.prompts[0].ids + list(ids), info, RESUME_FIELD)
    return list(ids)


def _resumed_limit(limit: int, resume: list[int], mode: str) -> int:
    """max_new_tokens of a resumed leg: what is left of the request's (a prefill server makes
    one token whatever)."""
    if mode == "prefill":
        return limit
    if len(resume) >= limit:
        raise bad(f"{RESUME_FIELD} holds {len(resume)} tokens: the request's max_new_tokens "
                  f"({limit}) is spent", RESUME_FIELD)
    return limit - len(resume)
