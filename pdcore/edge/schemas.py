"""Request bodies of the generate routes (pydantic).

Every model allows extra fields: SGLang clients and sglang-router add defaults we do not use
(`log_metrics`, `return_hidden_states`, `separate_reasoning`, ...) and they must not be rejected.
Ranges are checked in `pdcore.server.params`, so that errors name the field consistently.

Numbers must be JSON numbers: an `Int` field takes a JSON integer only, a `Float` field an integer
or a decimal; a string ("40000") or a boolean is a 400, as OpenAI answers it. pydantic's lax
mode would turn "40000" into 40000 after every bound had looked at a string and let it pass
(limits.check_body bounds the parsed JSON, which both the servers and the router validate
against these models first: limits.check_request).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

# pydantic's strict mode per field (checked in its core, no Python call per token id): an Int
# takes a JSON integer only, a Float an integer or a decimal; strings and booleans are refused
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
BootstrapHost = str | list[str | None] | None
BootstrapInt = Int | list[Int | None] | None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "tuple"}


def _param(loc: tuple[Any, ...]) -> str | None:
    """("body", "sampling_params", "SamplingParamsIn", "max_new_tokens") -> the field path;
    pydantic puts union member tags (type names) into locations, which we drop."""
    parts: list[str] = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _TYPE_TAGS or "[" in p or "(" in p or p[:1].isupper():
            continue
        else:
            parts.append(("." if parts else "") + p)
    return "".join(parts) or None


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """pydantic's (or FastAPI's) validation errors -> (message, the field path)."""
    if not errors:
        return "invalid request", None
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            return f"request body is not valid JSON: {detail}".rstrip(": "), "body"
    e = max(errors, key=lambda e: len(e.get("loc", ())))  # the most specific one
    param = _param(tuple(e.get("loc", ())))
    if e.get("type") == "missing":
        if param is None:
            return "request body is required (JSON object)", "body"
        return f"{param} is required", param
    if param is None:
        return f"request body must be a JSON object: {e.get('msg')}", "body"
    hint = ""
    if e.get("type") in ("int_type", "float_type") and isinstance(e.get("input"), (str, bool)):
        hint = "; numbers must be JSON numbers (5, not \"5\")"
    return f"{param}: {e.get('msg')} (got {e.get('input')!r:.80}){hint}", param


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class PDFields(_Open):
    """Fields the PD router adds to every generate request (ignored in unified mode)."""

    bootstrap_host: BootstrapHost = None
    bootstrap_port: BootstrapInt = None
    bootstrap_room: BootstrapInt = None
    bootstrap_sig: BootstrapHost = None  # the router's signature of the route (route_auth)
    routed_dp_rank: Int | None = None
    disagg_prefill_dp_rank: Int | None = None
    data_parallel_rank: Int | None = None
    rid: str | list[str] | None = None
    # migration (pdserve's router, router/migrate.py): the output tokens an earlier leg of this
    # request already streamed, which this leg continues after; and whether a stream carries
    # each event's new token ids in an SSE comment (`: pd-ids 1,2`) the router strips
    pd_resume_ids: list[Int] | None = None
    pd_stream_ids: bool = False


class SamplingParamsIn(_Open):
    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        # clients serialise unset options as null; treat them as "use the default"
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    # the fields of pdcore.messages.io.SamplingParams as JSON types; None (or absent) takes
    # the default declared there, once (params.build_sampling checks the ranges)
    max_new_tokens: Int | None = None
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    seed: Int | None = None
    sampling_seed: Int | None = None  # SGLang's other name for seed
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Int = 1
    logit_bias: dict[str, Float] | None = None
    min_new_tokens: Int | None = None
    # structured output (pdcore.constrained): at most one; a schema may be an object or text
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class GenerateRequest(PDFields):
    text: str | list[str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: Int | list[Int] = -1
    top_logprobs_num: Int | list[Int] = 0
    return_text_in_logprobs: bool = False
    timeout: Float | None = Field(default=None, description="seconds; pdserve extension")


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIBase(PDFields):
    model: str | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    seed: Int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    logit_bias: dict[str, Float] | None = None
    min_tokens: Int | None = None  # vLLM's and SGLang's extension (SGLang's min_new_tokens)
    user: str | None = None
    timeout: Float | None = None
    # structured output: OpenAI's response_format, or SGLang's regex / ebnf / json_schema
    response_format: dict[str, Any] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None


# "developer" is OpenAI's newer name for "system"; "tool" answers a tool call (the legacy
# "function" role is refused, as are `functions`)
ChatRole = Literal["system", "user", "assistant", "developer", "tool"]


class ChatMessage(_Open):
    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning (templates may use it)

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: the first call only (chat_tools)
    separate_reasoning: bool = True  # with --reasoning-parser: reasoning_content apart
    # variables for the chat template (Qwen3's enable_thinking, ...); reasoning_effort is one
    # too, for templates that read it (openai_routes.render_chat)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class ResponsesRequest(_OpenAIBase):
    """OpenAI's Responses API (`/v1/responses`, server/responses_api.py): `input` is a text or
    a list of items (messages, function calls and their outputs); the sampling fields are the
    chat route's, declared once in _OpenAIBase."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: the template's reasoning_effort
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
