"""OpenAI requests -> the planner's input (PlanInput), model-name checks, usage and finish
reasons."""

from __future__ import annotations

import os
from typing import Any

from pdcore.constrained.spec import spec_from_fields, spec_from_response_format
from pdcore.edge.schemas import ChatCompletionRequest, CompletionRequest
from pdcore.messages.io import GrammarSpec
from pdcore.route_auth import RequestGuard, RouteGuard
from pdcore.runtime import EngineHandle
from pdcore.server.output import OutputAssembler
from pdcore.server.params import bad, check_n
from pdcore.server.planner import Plan, PlanInput, PromptInput, plan, sampling_fields

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def served_model_name(engine: EngineHandle) -> str:
    return (engine.args.served_model_name or engine.info.served_model_name
            or os.path.basename(engine.info.model_path or "default"))


def accepted_model_names(engine: EngineHandle) -> set[str]:
    names = {served_model_name(engine)}
    for p in (engine.args.model_path, engine.info.model_path,
              engine.info.served_model_name):
        if p:
            p = str(p).rstrip("/")
            base = os.path.basename(p)
            names.update({p, os.path.abspath(os.path.expanduser(p)), base})
            if base.endswith(".gguf"):
                names.add(base[: -len(".gguf")])
    return names


# sglang-router (0.3.x) fills a request that named no model with this placeholder
ROUTER_NO_MODEL = "unknown"


def check_model(model: str | None, engine: EngineHandle) -> str:
    served = served_model_name(engine)
    if model in (None, "", ROUTER_NO_MODEL):
        return served
    if model in accepted_model_names(engine):
        return model
    raise bad(f"model {model!r} is not served here; use {served!r} (see /v1/models)", "model")


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


def plan_openai(body: CompletionRequest | ChatCompletionRequest, engine: EngineHandle,
                prompts: list[list[int]], prompt_field: str, *, want_logprobs: bool, top: int,
                echo: bool, id_prefix: str, guard: RouteGuard | RequestGuard,
                tool_grammar: GrammarSpec | None = None,
                max_tokens_field: str | None = None) -> Plan:
    """An OpenAI route's request as the planner's PlanInput (one n and one set of sampling
    options for every prompt; the model's own sampling defaults apply), then planner.plan.
    The cap on new tokens is `max_completion_tokens` (what sglang-router sends), else
    `max_tokens`; `max_tokens_field` names it in errors where the client used another name
    (/v1/responses: max_output_tokens)."""
    max_tokens, name = body.max_tokens, "max_tokens"
    if getattr(body, "max_completion_tokens", None) is not None:
        max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    model = check_model(body.model, engine)
    n = check_n(body.n)
    sampling = {**sampling_fields(body), "min_new_tokens": body.min_tokens,
                "grammar": _grammar(body, tool_grammar)}
    inp = PlanInput(
        [PromptInput(ids, f"{prompt_field}[{i}]" if len(prompts) > 1 else prompt_field,
                     sampling, max_tokens, n, want_logprobs, 0 if echo else -1, top)
         for i, ids in enumerate(prompts)],
        body, body.rid, body.stream, max_tokens_field=max_tokens_field or name,
        model_defaults=True, id_prefix=id_prefix)
    out = plan(inp, engine, guard)
    out.model, out.want_logprobs, out.top_logprobs = model, want_logprobs, top
    out.echo_texts = [engine.tokenizer.decode(ids) for ids in prompts] if echo else []
    return out


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
