"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models`.

Accepted model names: the served name, the model path and its basename (with or without .gguf).
`max_completion_tokens` (what sglang-router sends) wins over `max_tokens`. Chat prompts come from
the tokenizer's chat template with the generation prompt added.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdcore.constrained.spec import load_client_json
from pdcore.edge.schemas import ChatCompletionRequest, CompletionRequest
from pdcore.edge.streams import ClosingStreamingResponse
from pdcore.errors import InvalidRequestError
from pdcore.runtime import EngineError, EngineHandle
from pdcore.server import logprobs as lpfmt
from pdcore.server.chat_encode import encode_chat
from pdcore.server.tools.chat_tools import ChoiceShaper, plan_output
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
from pdcore.server.openai_plan import finish_of, plan_openai, served_model_name, usage
from pdcore.server.planner import Plan
from pdcore.server.output import OutputAssembler
from pdcore.server.params import bad, needs_text, request_guard

router = APIRouter()
MAX_TOP_LOGPROBS = 20
OFF_LOOP_CHARS = 8 * 1024  # a longer output is split into reasoning / content / tool calls on a
# worker thread: the parsers are linear and capped, but the event loop serves everyone else


async def shaped(fn: Any, text: str, *args: Any) -> Any:
    """fn(text, *args), on a worker thread when `text` is long."""
    if len(text) > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, text, *args)
    return fn(text, *args)


def _stream_usage_requested(body: Any) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _continuous_usage(body: Any) -> bool:
    """stream_options.continuous_usage_stats: every chunk carries the usage of the choices in it
    so far (SGLang and vLLM; guidellm asks for it)."""
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


def _running_usage(plan: Plan, counts: dict[int, int]) -> dict[str, int]:
    """Usage of the choices a chunk holds: {choice index: completion tokens so far}."""
    prompt = sum(len(plan.prompts[i // plan.n]) for i in counts)
    done = sum(counts.values())
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def run_plan(request: Request, engine: EngineHandle, plan: Plan, timeout: float | None
               ) -> list[OutputAssembler] | Response:
    try:
        return await unless_disconnected(
            request, collect(engine, plan.items, request.app.state.metrics, timeout))
    except ClientDisconnected:
        return error_response("client disconnected", 499)
    except EngineError as e:
        return engine_error_response(e)


async def _stream(request: Request, engine: EngineHandle, plan: Plan, body: Any, chat: bool,
                  shapers: dict[int, ChoiceShaper] | None = None) -> AsyncIterator[bytes]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    text_of = lpfmt.TokenText(engine.tokenizer)
    sent_text = {it.index: 0 for it in plan.items}
    sent_lp = {it.index: 0 for it in plan.items}
    finished: dict[int, OutputAssembler] = {}
    continuous = _continuous_usage(body)
    # /v1/completions echo: the prompt comes first; with logprobs its chunk waits for the
    # prompt's logprobs (the item's first event). Offsets run on across chunks, after the echo.
    echo_lp = bool(plan.echo_texts) and plan.want_logprobs and not chat
    lp_pos = {it.index: _echo_chars(plan, it.index, text_of) if echo_lp else 0
              for it in plan.items}
    echoed: set[int] = set()
    # a migrated stream (router/migrate.py): its client has the opening chunk and the text of
    # the output so far; `pd_stream_ids`: each chunk's new token ids in a comment before it
    resumed = body.pd_resume_ids is not None
    ids_sent: dict[int, int] | None = {} if body.pd_stream_ids else None
    started: set[int] = set()

    def chunk(choices: list[dict[str, Any]], counts: dict[int, int] | None = None) -> bytes:
        data = {"id": plan.rid, "object": obj, "created": created, "model": plan.model,
                "choices": choices}
        if continuous:
            data["usage"] = _running_usage(plan, counts or {c["index"]: 0 for c in choices})
        return sse(data)

    try:
        none = b"" if ids_sent is None else b": pd-ids \n"  # an event that adds no token
        if resumed:
            pass
        elif chat:
            yield none + chunk([{"index": it.index, "delta": {"role": "assistant",
                                                              "content": ""},
                                 "logprobs": None, "finish_reason": None} for it in plan.items])
        elif plan.echo_texts and not echo_lp:
            yield none + chunk([{"index": it.index, "text": plan.echo_texts[it.index // plan.n],
                                 "logprobs": None, "finish_reason": None} for it in plan.items])
        async with contextlib.aclosing(run_items(engine, plan.items, request.app.state.metrics,
                                                 body.timeout)) as events:
            async for ev in events:
                if ev.error is not None:
                    yield sse_error(str(ev.error), ev.error.status, ev.error.code)
                    break
                a, i = ev.asm, ev.index
                if i not in started:
                    started.add(i)
                    if resumed:
                        echoed.add(i)
                        sent_text[i] = a.resumed_visible
                        # completions logprobs: text_offset runs on after the tokens sent
                        lp_pos[i] += sum(len(text_of(t)) for t in a.out.output_ids[:a.resumed])
                        if shapers is not None:  # the shaper's state after the text so far
                            shapers[i].delta(a.out.text[:a.resumed_visible], False, None)
                if echo_lp and i not in echoed:  # unified: the prompt's entries; PD decode: none
                    echoed.add(i)  # (the router puts P's there)
                    entries = list(a.out.input_logprobs or [])
                    yield chunk([{"index": i, "text": plan.echo_texts[i // plan.n],
                                  "logprobs": lpfmt.completion(entries, text_of),
                                  "finish_reason": None}])
                text = a.out.text if ev.done else a.visible_text()
                delta, sent_text[i] = text[sent_text[i]:], len(text)
                new_lps = a.out.output_logprobs[sent_lp[i]:] if plan.want_logprobs else []
                sent_lp[i] += len(new_lps)
                reason, matched = finish_of(a) if ev.done else (None, None)
                if not delta and not new_lps and not ev.done:
                    continue
                if chat:
                    fields: dict[str, Any] = {"content": delta} if delta else {}
                    if shapers is not None:  # reasoning / tool calls: the shaper splits them
                        shape = shapers[i].delta  # the last one parses the calls: maybe long
                        fields, reason = (await shaped(shape, text, True, reason) if ev.done
                                          else shape(text, False, reason))
                        if not fields and not new_lps and not ev.done:
                            continue  # held back: it may open a tool call or a marker
                    c: dict[str, Any] = {"index": i, "delta": fields, "logprobs": None,
                                         "finish_reason": reason}
                    if new_lps:
                        c["logprobs"] = {"content": lpfmt.chat(new_lps, text_of,
                                                               plan.top_logprobs > 0)}
                else:
                    c = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
                    if new_lps:
                        c["logprobs"] = lpfmt.completion(new_lps, text_of, lp_pos[i])
                        lp_pos[i] += sum(map(len, c["logprobs"]["tokens"]))
                if ev.done:
                    c["matched_stop"] = matched
                    finished[i] = a
                data = chunk([c], {i: len(a.out.output_ids)})
                yield data if ids_sent is None else ids_comment(a, ids_sent, i) + data
        if _stream_usage_requested(body) and len(finished) == len(plan.items):
            outs = [finished[it.index] for it in plan.items]
            yield sse({"id": plan.rid, "object": obj, "created": created, "model": plan.model,
                       "choices": [], "usage": usage(plan, outs)})
    except Exception as e:  # noqa: BLE001 - headers are out already: report in-band
        yield sse_error(f"internal error: {type(e).__name__}: {e}", 500)
    yield SSE_DONE


def _echo_chars(plan: Plan, index: int, text_of: lpfmt.TokenText) -> int:
    """Where the first sampled token's text_offset starts after an echoed prompt: the length of
    the prompt tokens' texts (what the prompt's own entries add up to)."""
    return sum(len(text_of(t)) for t in plan.prompts[index // plan.n])


# ---- /v1/completions --------------------------------------------------------------------------
def _completion_prompts(body: CompletionRequest, engine: EngineHandle) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [list(engine.tokenizer.encode(p))]
    if not p:
        raise bad("prompt is empty", "prompt")
    if isinstance(p[0], str):
        return [list(engine.tokenizer.encode(x)) for x in p]  # type: ignore[arg-type]
    if isinstance(p[0], int):
        return [list(p)]  # type: ignore[arg-type]
    return [list(x) for x in p]  # type: ignore[union-attr]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine: EngineHandle = request.app.state.engine
    engine.require_ready()
    needs_text(engine.args, "/v1/completions", "prompt")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    want = body.logprobs is not None
    plan = plan_openai(body, engine, _completion_prompts(body, engine), "prompt",
                        want_logprobs=want, top=body.logprobs or 0, echo=body.echo,
                        id_prefix="cmpl", guard=await request_guard(request))
    if body.stream:
        return ClosingStreamingResponse(_stream(request, engine, plan, body, chat=False),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await run_plan(request, engine, plan, body.timeout)
    if isinstance(outs, Response):
        return outs
    text_of = lpfmt.TokenText(engine.tokenizer)
    choices = []
    for i, a in enumerate(outs):
        reason, matched = finish_of(a)
        echo = plan.echo_texts[i // plan.n] if plan.echo_texts else ""
        logprobs = None
        if want:
            entries = list(a.out.input_logprobs or []) if body.echo else []
            # PD decode has no prompt logprobs (the router puts P's first): its offsets still
            # start after the echoed prompt, as a unified server's do
            start = _echo_chars(plan, i, text_of) if body.echo and not entries else 0
            logprobs = lpfmt.completion(entries + a.out.output_logprobs, text_of, start)
        choices.append({"index": i, "text": echo + a.out.text, "logprobs": logprobs,
                        "finish_reason": reason, "matched_stop": matched})
    return JSONResponse({"id": plan.rid, "object": "text_completion", "created": int(time.time()),
                         "model": plan.model, "choices": choices, "usage": usage(plan, outs)})


# ---- /v1/chat/completions ---------------------------------------------------------------------
def _message_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") not in ("text", None):
            raise bad(f"messages: content type {part.get('type')!r} is not supported (text only)",
                      "messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _message(m: Any, i: int = 0) -> dict[str, Any]:
    """A chat message as chat templates read it (tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": m.role, "content": _message_text(m.content)}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    if m.tool_calls:
        out["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                             for j, c in enumerate(m.tool_calls)]
    return out


def _template_call(call: dict[str, Any], where: str = "messages") -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad("messages: a tool call must be {\"id\", \"type\": \"function\", "
                  "\"function\": {\"name\", \"arguments\"}}", "messages")
    fn = dict(fn)
    if isinstance(fn.get("arguments"), str):  # not JSON: the template gets the text as sent
        fn["arguments"] = load_client_json(fn["arguments"], where + ".function.arguments",
                                           keep_text=True)
    return {**call, "function": fn}


# OpenAI's reasoning_effort values; a template that reads the variable gets one of them
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_kwargs(kwargs: dict[str, Any] | None, effort: str | None, tokenizer: Any,
                    field: str = "chat_template_kwargs") -> dict[str, Any]:
    """The chat template's extra variables: `chat_template_kwargs` as sent (Qwen3's
    enable_thinking, ...) and `reasoning_effort` (as vLLM passes it: templates that read it,
    gpt-oss's among them, use it; the others render as without it). A key that is one of
    apply_chat_template's own parameters (tools, tokenize, ...) is a 400: it is not a template
    variable and would change how the prompt is made."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                  f"{effort!r}", "reasoning_effort")
    out: dict[str, Any] = {} if effort is None else {"reasoning_effort": effort}
    reserved = _template_parameters(type(tokenizer))
    for key, value in (kwargs or {}).items():
        if key in reserved:
            raise bad(f"{field}.{key} is a parameter of the chat template call, not a "
                      "template variable; use the request field instead", f"{field}.{key}")
        out[key] = value
    return out


def _template_parameters(cls: type) -> frozenset[str]:
    import inspect

    try:
        params = inspect.signature(cls.apply_chat_template).parameters.values()
    except (AttributeError, TypeError, ValueError):
        params = ()  # type: ignore[assignment]
    names = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(names | {"messages", "conversation", "self"})


def render_chat(tokenizer: Any, msgs: list[dict[str, Any]], *, cont: bool = False,
                tools: list[dict[str, Any]] | None = None,
                variables: dict[str, Any] | None = None, field: str = "messages",
                special_in_content: bool = False) -> list[int]:
    """Token ids of `msgs` rendered by the model's chat template (the generation prompt added
    unless the last message is continued); special-token spellings in the client's strings are
    text (chat_encode.py) unless `special_in_content` (--allow-special-tokens-in-messages)."""
    try:
        return encode_chat(tokenizer, msgs, add_generation_prompt=not cont,
                           continue_final_message=cont, tools=tools, variables=variables,
                           special_in_content=special_in_content)
    except InvalidRequestError:
        raise
    except Exception as e:
        raise bad(f"{field} do not fit the model's chat template: {e}", field) from e


def chat_prompt(body: ChatCompletionRequest, tokenizer: Any,
                tools: list[dict[str, Any]] | None = None,
                special_in_content: bool = False) -> list[int]:
    """The prompt ids; special-token spellings in the messages are text (chat_encode.py)
    unless `special_in_content` (--allow-special-tokens-in-messages)."""
    if not body.messages:
        raise bad("messages must not be empty", "messages")
    variables = template_kwargs(body.chat_template_kwargs, body.reasoning_effort, tokenizer)
    return render_chat(tokenizer, [_message(m, i) for i, m in enumerate(body.messages)],
                       cont=bool(body.continue_final_message), tools=tools, variables=variables,
                       special_in_content=special_in_content)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine: EngineHandle = request.app.state.engine
    engine.require_ready()
    needs_text(engine.args, "/v1/chat/completions", "messages")
    top = body.top_logprobs or 0
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if not body.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    tools, reasoning = plan_output(body, engine)
    plan = plan_openai(body, engine, [chat_prompt(
                            body, engine.tokenizer, tools.template_tools if tools else None,
                            engine.args.allow_special_tokens_in_messages)],
                        "messages",
                        want_logprobs=bool(body.logprobs), top=top, echo=False,
                        id_prefix="chatcmpl", guard=await request_guard(request),
                        tool_grammar=tools.grammar if tools else None)
    shapers = {it.index: ChoiceShaper(reasoning, tools) for it in plan.items} \
        if (tools and tools.parser) or reasoning else None
    if body.stream:
        return ClosingStreamingResponse(_stream(request, engine, plan, body, chat=True, shapers=shapers),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await run_plan(request, engine, plan, body.timeout)
    if isinstance(outs, Response):
        return outs
    text_of = lpfmt.TokenText(engine.tokenizer)
    choices = []
    for i, a in enumerate(outs):
        reason, matched = finish_of(a)
        logprobs = ({"content": lpfmt.chat(a.out.output_logprobs, text_of, top > 0)}
                    if body.logprobs else None)
        message: dict[str, Any] = {"role": "assistant", "content": a.out.text}
        if shapers is not None:
            message, reason = await shaped(shapers[i].message, a.out.text, reason)
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": reason, "matched_stop": matched})
    return JSONResponse({"id": plan.rid, "object": "chat.completion", "created": int(time.time()),
                         "model": plan.model, "choices": choices, "usage": usage(plan, outs)})


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    engine: EngineHandle = request.app.state.engine
    return {"object": "list", "data": [{
        "id": served_model_name(engine), "object": "model", "created": int(time.time()),
        "owned_by": "pdserve", "root": engine.info.model_path or engine.args.model_path,
        "max_model_len": engine.info.context_length}]}
