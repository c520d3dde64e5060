"""OpenAI requests -> scheduler items (Plan), model-name checks, usage and finish reasons."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdcore.engine.io_struct import GrammarSpec
from pdcore.engine.sched.grammar import spec_from_fields, spec_from_response_format
from pdcore.route_auth import RouteGuard
from pdcore.runtime import EngineClient, new_rid
from pdcore.server.generation import Item
from pdcore.server.output import OutputAssembler
from pdcore.server.params import (
    bad,
    build_sampling,
    check_n,
    check_prompt,
    clamp_max_new_tokens,
    make_req,
    pd_items,
    preferred_sampling,
    sample_item,
)
from pdcore.server.schemas import ChatCompletionRequest, CompletionRequest

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def served_model_name(engine: EngineClient) -> str:
    return (engine.args.served_model_name or engine.info.get("served_model_name")
            or os.path.basename(str(engine.info.get("model_path") or "default")))


def accepted_model_names(engine: EngineClient) -> set[str]:
    names = {served_model_name(engine)}
    for p in (engine.args.model_path, engine.info.get("model_path"),
              engine.info.get("served_model_name")):
        if p:
            p = str(p).rstrip("/")
            base = os.path.basename(p)
            names.update({p, os.path.abspath(os.path.expanduser(p)), base})
            if base.endswith(".gguf"):
                names.add(base[: -len(".gguf")])
    return names


# sglang-router (0.3.x) fills a request that named no model with this placeholder
ROUTER_NO_MODEL = "unknown"


def check_model(model: str | None, engine: EngineClient) -> str:
    served = served_model_name(engine)
    if model in (None, "", ROUTER_NO_MODEL):
        return served
    if model in accepted_model_names(engine):
        return model
    raise bad(f"model {model!r} is not served here; use {served!r} (see /v1/models)", "model")


@dataclass
class Plan:
    items: list[Item]
    prompts: list[list[int]]
    n: int
    model: str
    rid: str
    want_logprobs: bool = False
    top_logprobs: int = 0
    echo_texts: list[str] = field(default_factory=list)


def _grammar(body: CompletionRequest | ChatCompletionRequest,
             tool_grammar: GrammarSpec | None = None) -> GrammarSpec | None:
    """response_format, SGLang's top-level json_schema / regex / ebnf, or the grammar that
    forces a tool call (chat_tools.plan_tools): at most one."""
    rf = spec_from_response_format(body.response_format)
    own = spec_from_fields({"json_schema": body.json_schema, "regex": body.regex,
                            "ebnf": body.ebnf})
    named = [g for g in (rf, own, tool_grammar) if g is not None]
    if len(named) > 1:
        raise bad(f"{named[0].field} and {named[1].field} both constrain the output; send one",
                  named[1].field)
    return named[0] if named else None


def plan_request(body: CompletionRequest | ChatCompletionRequest, engine: EngineClient,
          prompts: list[list[int]], prompt_field: str, max_tokens: int | None,
          max_tokens_field: str, default_max: int | None, want_logprobs: bool, top: int,
          echo: bool, id_prefix: str, guard: RouteGuard,
          tool_grammar: GrammarSpec | None = None) -> Plan:
    args, info = engine.args, engine.info
    model = check_model(body.model, engine)
    n = check_n(body.n)
    for i, ids in enumerate(prompts):
        check_prompt(ids, info, f"{prompt_field}[{i}]" if len(prompts) > 1 else prompt_field,
                     args.allow_auto_truncate)
    given = {"max_new_tokens": max_tokens, "min_new_tokens": body.min_tokens,
             "grammar": _grammar(body, tool_grammar)}
    for name in ("stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim",
                 "seed", "logit_bias", "temperature", "top_p", "top_k", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty"):
        given[name] = getattr(body, name)
    for name, value in (info.get("sampling_defaults") or {}).items():
        if given.get(name) is None:  # --sampling-defaults model: the model's own values
            given[name] = value
    pds = pd_items(body, [n] * len(prompts), args, guard)
    rid = body.rid if isinstance(body.rid, str) else f"{id_prefix}-{uuid.uuid4().hex}"
    rids = body.rid if isinstance(body.rid, list) else None
    if rids is not None and len(rids) != len(prompts) * n:
        raise bad(f"rid has {len(rids)} entries for {len(prompts) * n} choices", "rid")
    items: list[Item] = []
    for p, ids in enumerate(prompts):
        leader: Item | None = None
        for j in range(n):
            k = p * n + j
            sampling = build_sampling(given, names={"max_new_tokens": max_tokens_field},
                                      defaults=preferred_sampling(args.preferred_sampling_params))
            if sampling.seed is not None and j:
                sampling.seed += j
            clamp_max_new_tokens(sampling, len(ids), info, default_max, args.disaggregation_mode)
            req = make_req(rids[k] if rids else (rid if len(prompts) * n == 1 else new_rid()),
                           ids, sampling, pds[p], return_logprob=want_logprobs,
                           logprob_start_len=0 if (echo and want_logprobs) else -1,
                           top_logprobs_num=top, stream=body.stream)
            items.append(sample_item(k, req, leader, args.disaggregation_mode))
            leader = leader or items[-1]
    echo_texts = [engine.tokenizer.decode(ids) for ids in prompts] if echo else []
    return Plan(items, prompts, n, model, rid, want_logprobs, top, echo_texts)


def usage(plan: Plan, outs: list[OutputAssembler]) -> dict[str, Any]:
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(len(a.out.output_ids) for a in outs)
    cached = sum(a.out.cached_tokens for a in outs[:: plan.n]) if outs else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_of(asm: OutputAssembler) -> tuple[str | None, Any]:
    r = asm.out.finish_reason or {}
    return _FINISH.get(r.get("type", ""), r.get("type")), r.get("matched")
