"""Request fields pdserve accepts in its schemas' spirit but does not implement yet.

Clients and sglang-router send SGLang's and OpenAI's defaults for many fields (`log_metrics`,
`separate_reasoning`, `return_hidden_states: false`, ...), so a known field is refused only when
its value would change the answer: HTTP 400 naming the field beats an answer that silently
ignores a constraint (a `json_schema` the text does not follow, a tool never called).
docs/http-api.md lists these fields ("No silent no-ops"); a later issue that implements one
removes it here.
"""

from __future__ import annotations

from typing import Any

from pdcore.errors import InvalidRequestError

# field -> values that leave the answer unchanged; null (JSON null) is always accepted
_ANY_ROUTE: dict[str, tuple[Any, ...]] = {
    "lora_path": (), "lora_id": (), "session_params": (), "custom_logit_processor": (),
    "token_ids_logprob": (), "input_embeds": (), "priority": (),
    "image_data": ([],), "video_data": ([],), "audio_data": ([],),
    "return_hidden_states": (False,), "return_entropy": (False,), "return_bytes": (False,),
    "background": (False,),
}
# served, but under another name or place on this route: field -> where it goes
_MISPLACED: dict[str, dict[str, str]] = {
    "/generate": {"min_tokens": "sampling_params.min_new_tokens",
                  "min_new_tokens": "sampling_params.min_new_tokens",
                  "logit_bias": "sampling_params.logit_bias",
                  "json_schema": "sampling_params.json_schema", "regex": "sampling_params.regex",
                  "ebnf": "sampling_params.ebnf",
                  "structural_tag": "sampling_params.structural_tag",
                  "response_format": "sampling_params.json_schema"},
    "openai": {"min_new_tokens": "min_tokens",
               "structural_tag": 'response_format {"type": "structural_tag", ...}'},
    "/v1/responses": {"messages": "input", "max_tokens": "max_output_tokens",
                      "max_completion_tokens": "max_output_tokens",
                      "response_format": 'text {"format": ...}'},
}
_OPENAI: dict[str, tuple[Any, ...]] = {
    "functions": ([],), "function_call": ("none",), "audio": (), "prediction": (), "modalities": (["text"],),
    "store": (False,), "suffix": ("",),
}
# /v1/responses (responses_routes.py): responses are not stored, nothing is truncated (listed
# in docs/openai-api.md)
_RESPONSES: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (), "conversation": (), "prompt": (), "include": ([],),
    "truncation": ("disabled",), "top_logprobs": (0,), "max_tool_calls": (),
}
_SAMPLING: dict[str, tuple[Any, ...]] = {
    "stop_regex": (),
    "custom_params": (), "stream_interval": (),
    "spaces_between_special_tokens": (True,),
}
_MESSAGE: dict[str, tuple[Any, ...]] = {"function_call": ()}
# stream_options: include_usage and continuous_usage_stats are both served
_STREAM_OPTIONS: dict[str, tuple[Any, ...]] = {}


def names() -> dict[str, list[str]]:
    """Every refused field by where it lives (for the docs/http-api.md list and tests)."""
    return {"any route": sorted(_ANY_ROUTE), "OpenAI routes": sorted(_OPENAI),
            "sampling_params": sorted(_SAMPLING), "chat messages": sorted(_MESSAGE),
            "stream_options": sorted(_STREAM_OPTIONS)}


def _check(obj: dict[str, Any], table: dict[str, tuple[Any, ...]], prefix: str) -> None:
    for key, neutral in table.items():
        value = obj.get(key)
        # bool is an int in Python: `0 == False`, so compare types too
        if value is None or any(type(value) is type(v) and value == v for v in neutral):
            continue
        field = prefix + key
        allowed = ", ".join(repr(v) for v in neutral)
        also = f" (accepted: null, {allowed})" if allowed else " (accepted: null)"
        raise InvalidRequestError(f"{field} is not implemented by pdserve yet{also}", field)


def check_unsupported(route: str, body: dict[str, Any]) -> None:
    """400 naming the first field of `body` that asks for something not implemented."""
    _check(body, _ANY_ROUTE, "")
    for key, there in _MISPLACED["/generate" if route == "/generate" else "openai"].items():
        if body.get(key) not in (None, 0, {}) or isinstance(body.get(key), bool):
            raise InvalidRequestError(f"{key} goes in {there} on {route}", key)
    if route == "/generate":
        sps = body.get("sampling_params")
        for i, sp in enumerate(sps if isinstance(sps, list) else [sps]):
            if isinstance(sp, dict):
                _check(sp, _SAMPLING, f"sampling_params[{i}]." if isinstance(sps, list)
                       else "sampling_params.")
        return
    _check(body, _OPENAI, "")
    if route == "/v1/responses":
        _check(body, _RESPONSES, "")
        for key, there in _MISPLACED[route].items():
            if body.get(key) is not None:
                raise InvalidRequestError(f"{key} is {there} on {route}", key)
    if route == "/v1/completions":  # chat-only fields: refused rather than ignored here
        for key in ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                    "reasoning_effort"):
            if body.get(key) not in (None, [], {}, "none"):
                raise InvalidRequestError(f"{key} is served on /v1/chat/completions, not on "
                                          f"{route}", key)
    _check(body, _SAMPLING, "")  # OpenAI routes take SGLang's sampling extras at top level
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise InvalidRequestError("best_of is not implemented by pdserve yet (accepted: null, "
                                  "or equal to n)", "best_of")
    if isinstance(body.get("stream_options"), dict):
        _check(body["stream_options"], _STREAM_OPTIONS, "stream_options.")
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                _check(m, _MESSAGE, f"messages[{i}].")
