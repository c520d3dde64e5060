"""SGLang-native `/generate`: `text` or `input_ids` (single or batch), `sampling_params`
(dict, or one per prompt; `n` samples each), `stream` (SSE with cumulative text, then
`data: [DONE]`), logprobs, bootstrap fields. A batch answers a list, one entry per sample."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdcore.constrained.spec import spec_from_fields
from pdcore.edge.schemas import GenerateRequest, SamplingParamsIn
from pdcore.edge.streams import ClosingStreamingResponse
from pdcore.runtime import EngineError, EngineHandle
from pdcore.server import logprobs as lpfmt
from pdcore.server.generation import (
    SSE_DONE,
    SSE_HEADERS,
    ClientDisconnected,
    collect,
    ids_comment,
    run_items,
    sse,
    unless_disconnected,
)
from pdcore.server.http_errors import engine_error_response, error_response, sse_error
from pdcore.server.output import OutputAssembler
from pdcore.server import planner
from pdcore.server.params import bad, check_n, needs_text, per_item, request_guard
from pdcore.server.planner import Plan, PlanInput, PromptInput, sampling_fields

router = APIRouter()
DEFAULT_MAX_NEW_TOKENS = 128
PREFIX = "sampling_params."


def _prompts(body: GenerateRequest, engine: EngineHandle) -> tuple[list[list[int]], bool, str]:
    if body.text is not None and body.input_ids is not None:
        raise bad("give either text or input_ids, not both", "text")
    if body.input_ids is not None:
        ids = body.input_ids
        if ids and isinstance(ids[0], list):
            return [list(x) for x in ids], True, "input_ids"  # type: ignore[arg-type]
        return [list(ids)], False, "input_ids"  # type: ignore[arg-type]
    if body.text is None:
        raise bad("text or input_ids is required", "text")
    needs_text(engine.args, "a text prompt", "text")
    texts = body.text if isinstance(body.text, list) else [body.text]
    if not texts:
        raise bad("text is an empty list", "text")
    tok = engine.tokenizer
    return [list(tok.encode(t)) for t in texts], isinstance(body.text, list), "text"


def generate_input(body: GenerateRequest, engine: EngineHandle) -> PlanInput:
    """/generate's request as the planner's PlanInput: sampling_params, n and the logprob
    fields per prompt (a scalar applies to all); errors name `sampling_params.<field>`."""
    prompts, batch, field = _prompts(body, engine)
    if not prompts:
        raise bad(f"{field} is an empty list", field)
    sps = body.sampling_params
    sp_list: list[SamplingParamsIn] = per_item(
        sps if sps is not None else SamplingParamsIn(), len(prompts), "sampling_params")
    rl = per_item(body.return_logprob, len(prompts), "return_logprob")
    lsl = per_item(body.logprob_start_len, len(prompts), "logprob_start_len")
    tln = per_item(body.top_logprobs_num, len(prompts), "top_logprobs_num")
    if any(t < 0 for t in tln):
        raise bad("top_logprobs_num must be >= 0", "top_logprobs_num")
    ns = [check_n(sp.n, "sampling_params.n") for sp in sp_list]
    many = len(prompts) > 1
    out = []
    for p, (ids, sp) in enumerate(zip(prompts, sp_list)):
        given = sampling_fields(sp)
        if given.get("seed") is None:
            given["seed"] = sp.sampling_seed
        given["grammar"] = spec_from_fields(sp.model_dump(), PREFIX)
        out.append(PromptInput(ids, f"{field}[{p}]" if many else field, given,
                               sp.max_new_tokens, ns[p], bool(rl[p]), lsl[p],
                               tln[p] if rl[p] else 0))
    return PlanInput(out, body, body.rid, body.stream, default_max=DEFAULT_MAX_NEW_TOKENS,
                     field_prefix=PREFIX, batch=batch or sum(ns) > 1)


def _meta(asm: OutputAssembler, plan: Plan, idx: int, engine: EngineHandle,
          text_in_logprobs: bool, *, start: float, finished: bool) -> dict[str, Any]:
    o = asm.out
    meta: dict[str, Any] = {
        "id": o.rid, "finish_reason": o.finish_reason if finished else None,
        "prompt_tokens": o.prompt_tokens, "completion_tokens": len(o.output_ids),
        "cached_tokens": o.cached_tokens, "e2e_latency": round(time.time() - start, 6),
    }
    if engine.args.speculative_algorithm is not None:
        meta["spec_verify_ct"] = o.spec_verify_ct  # as SGLang reports it with speculation on
    want = plan.return_logprob[idx]
    if want or engine.args.disaggregation_mode == "decode":
        # decode servers always carry the key so a PD router can prepend prefill's prompt part
        text = lpfmt.TokenText(engine.tokenizer) if text_in_logprobs else None
        toks, tops = lpfmt.native(o.input_logprobs, text)
        meta["input_token_logprobs"] = toks
        if want:
            out_toks, out_tops = lpfmt.native(o.output_logprobs, text)
            meta["output_token_logprobs"] = out_toks
            if plan.top_logprobs_num[idx] > 0:
                meta["input_top_logprobs"] = tops
                meta["output_top_logprobs"] = out_tops
    return meta


def _result(asm: OutputAssembler, plan: Plan, idx: int, engine: EngineHandle,
            body: GenerateRequest, *, start: float, finished: bool) -> dict[str, Any]:
    # --skip-tokenizer-init: the answer is its token ids (output_ids), no text
    text = "" if engine.args.skip_tokenizer_init else \
        asm.out.text if finished else asm.visible_text()
    out: dict[str, Any] = {"text": text, "output_ids": list(asm.out.output_ids),
                           "meta_info": _meta(asm, plan, idx, engine,
                                              body.return_text_in_logprobs, start=start,
                                              finished=finished)}
    if plan.batch:
        out["index"] = idx
    return out


async def _stream(engine: EngineHandle, plan: Plan, body: GenerateRequest, request: Request,
                  start: float) -> AsyncIterator[bytes]:
    metrics = request.app.state.metrics
    ids_sent: dict[int, int] | None = {} if body.pd_stream_ids else None
    try:
        async with contextlib.aclosing(run_items(engine, plan.items, metrics, body.timeout)) \
                as events:
            async for ev in events:
                if ev.error is not None:
                    yield sse_error(str(ev.error), ev.error.status, ev.error.code)
                    break
                data = sse(_result(ev.asm, plan, ev.index, engine, body, start=start,
                                   finished=ev.done))
                if ids_sent is not None:  # the router's migration (router/migrate.py)
                    data = ids_comment(ev.asm, ids_sent, ev.index) + data
                yield data
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_error(f"internal error: {type(e).__name__}: {e}", 500)
    yield SSE_DONE


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    engine: EngineHandle = request.app.state.engine
    start = time.time()
    engine.require_ready()
    plan = planner.plan(generate_input(body, engine), engine, await request_guard(request))
    if body.stream:
        return ClosingStreamingResponse(_stream(engine, plan, body, request, start),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        done = await unless_disconnected(
            request, collect(engine, plan.items, request.app.state.metrics, body.timeout))
    except ClientDisconnected:
        return error_response("client disconnected", 499)
    except EngineError as e:
        return engine_error_response(e)
    results = [_result(a, plan, i, engine, body, start=start, finished=True)
               for i, a in enumerate(done)]
    return JSONResponse(results if plan.batch else results[0])
