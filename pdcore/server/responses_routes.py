"""`/v1/responses`: OpenAI's Responses API (SGLang serves it), whole or streamed.

The body becomes the chat request it means (responses_api.chat_request); the prompt, tools,
reasoning split, grammar and PD route are the chat route's; the answer is a Response object
with output items (reasoning, message, function_call) or, streamed, the Responses events
(response.created, output_item / content_part / output_text / function_call_arguments events,
response.completed or response.incomplete; an error mid-stream: error + response.failed).
Responses are not stored: `store` must be false (or absent) and `previous_response_id` is a 400.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdcore.edge.schemas import ResponsesRequest
from pdcore.edge.streams import ClosingStreamingResponse
from pdcore.runtime import EngineHandle
from pdcore.server.tools.chat_tools import ChoiceShaper, plan_output
from pdcore.server.generation import SSE_HEADERS, ids_comment, run_items
from pdcore.server.openai_plan import finish_of, plan_openai, usage
from pdcore.server.openai_routes import chat_prompt, run_plan, shaped
from pdcore.server.params import needs_text, request_guard
from pdcore.server.planner import Plan
from pdcore.server.responses_api import ResponseBuilder, chat_request

router = APIRouter()


def _usage(plan: Plan, outs: list) -> dict:  # type: ignore[type-arg]
    u = usage(plan, outs)
    return ResponseBuilder.usage(u["prompt_tokens"], u["completion_tokens"],
                                 u["prompt_tokens_details"]["cached_tokens"])


async def _stream(request: Request, engine: EngineHandle, plan: Plan, builder: ResponseBuilder,
                  shaper: ChoiceShaper, body: ResponsesRequest) -> AsyncIterator[bytes]:
    # a migrated stream (router/migrate.py): its client has the opening events and the text so
    # far, which the builder takes in silently (the router maps its ids and sequence numbers
    # onto the first leg's); `pd_stream_ids`: each event's new token ids in a comment before it
    resumed = body.pd_resume_ids is not None
    ids_sent: dict[int, int] | None = {} if body.pd_stream_ids else None
    none = b"" if ids_sent is None else b": pd-ids \n"  # an event that adds no token

    def marked(events: list[bytes], ids: bytes = b"") -> list[bytes]:
        return [(ids if k == 0 and ids else none) + b for k, b in enumerate(events)]

    if not resumed:
        for b in marked(builder.start()):
            yield b
    try:
        async with contextlib.aclosing(run_items(engine, plan.items, request.app.state.metrics,
                                                 body.timeout)) as events:
            async for ev in events:
                if ev.error is not None:
                    for b in marked(builder.failed(str(ev.error), ev.error.status)):
                        yield b
                    return
                a = ev.asm
                if resumed:
                    resumed = False
                    builder.delta(shaper.delta(a.out.text[:a.resumed_visible], False, None)[0])
                text = a.out.text if ev.done else a.visible_text()
                reason = finish_of(a)[0] if ev.done else None
                fields, reason = (await shaped(shaper.delta, text, True, reason) if ev.done
                                  else shaper.delta(text, False, reason))
                out = builder.delta(fields)
                if ev.done:
                    out += builder.finish(_usage(plan, [a]), reason)
                if not out:  # held back (or nothing new): the next event carries these ids
                    continue
                ids = b"" if ids_sent is None else ids_comment(a, ids_sent, ev.index)
                for b in marked(out, ids):
                    yield b
    except Exception as e:  # noqa: BLE001 - headers are out already: report in-band
        for b in marked(builder.failed(f"internal error: {type(e).__name__}: {e}", 500)):
            yield b


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    engine: EngineHandle = request.app.state.engine
    engine.require_ready()
    needs_text(engine.args, "/v1/responses", "input")
    chat = chat_request(body)
    tools, reasoning = plan_output(chat, engine)
    prompt = chat_prompt(chat, engine.tokenizer, tools.template_tools if tools else None,
                         engine.args.allow_special_tokens_in_messages)
    plan = plan_openai(chat, engine, [prompt], "input",
                        max_tokens_field="max_output_tokens", want_logprobs=False, top=0,
                        echo=False, id_prefix="resp", guard=await request_guard(request),
                        tool_grammar=tools.grammar if tools else None)
    builder = ResponseBuilder(body, plan.rid.replace("resp-", "resp_", 1), plan.model)
    shaper = ChoiceShaper(reasoning, tools)
    if body.stream:
        return ClosingStreamingResponse(_stream(request, engine, plan, builder, shaper, body),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await run_plan(request, engine, plan, body.timeout)
    if isinstance(outs, Response):
        return outs
    [a] = outs
    reason = finish_of(a)[0]
    message, reason = await shaped(shaper.message, a.out.text, reason)
    builder.whole(message)
    return JSONResponse(builder.response(builder.status_of(reason), _usage(plan, outs), reason))
