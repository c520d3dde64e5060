"""Request limits: every generate request is bounded and checked before it reaches a scheduler.

Two layers, both installed by `install_limits(app)` on the servers and on the router:
1. `BodySizeLimit` (ASGI middleware): a POST body over `max_request_bytes()` gets 413 from its
   Content-Length header, before a byte of it is read; a chunked body is counted as it arrives
   and refused the moment it passes the limit (parsing and tokenising a 20 MB prompt took 17 s
   just to refuse it for its length); a JSON body nested deeper than MAX_JSON_DEPTH gets 400 on
   every route.
2. `check_request` (a dependency of every generate route): validates the body against the
   route's schema (strict numbers: "40000" is not a number, schemas.py), then walks the parsed
   JSON once and answers 400 naming the field for what the pydantic schemas cannot see: lone surrogates
   (tokenisers and UTF-8 encoders raise on them), integers beyond 64 bits and non-finite
   numbers (they overflow in torch or the wire format), list and string sizes, values bounded
   by the model (vocabulary, context), and fields that are not implemented (`unsupported.py`).
The limits are module constants, documented in docs/http-api.md; the body limit can be changed
with PDCORE_MAX_REQUEST_BYTES.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pdcore.edge.unsupported import check_unsupported
from pdcore.env import ENV, Env
from pdcore.errors import InvalidRequestError
from pdcore.messages.info import EngineInfo
from pdcore.edge.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ResponsesRequest,
    validation_message,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = Env.pdcore_max_request_bytes.default
MAX_BATCH = 256  # prompts of one request
MAX_SAMPLES = 256  # prompts x n of one request
MAX_MESSAGES = 4096  # chat messages, and content parts of one message
MAX_STOP = 32  # stop strings
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_NAME_CHARS = 256  # rid, model, user, bootstrap_host
MAX_TOP_LOGPROBS_NUM = 100  # /generate; the OpenAI routes allow 20 as OpenAI does
MAX_TIMEOUT_S = 86400.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_DEPTH = 32  # JSON nesting of a generate request's fields
MAX_JSON_DEPTH = 64  # JSON nesting of any request body (BodySizeLimit)
INT64 = 1 << 63

GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
SCHEMAS: dict[str, type[BaseModel]] = {"/generate": GenerateRequest,
                                       "/v1/completions": CompletionRequest,
                                       "/v1/chat/completions": ChatCompletionRequest,
                                       "/v1/responses": ResponsesRequest}


def max_request_bytes() -> int:
    return ENV.pdcore_max_request_bytes


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse({"error": {
        "message": f"request body is larger than {limit} bytes (PDCORE_MAX_REQUEST_BYTES); "
                   "send a shorter prompt or raise the limit",
        "type": "invalid_request_error", "param": "body", "code": 413}}, status_code=413)


def _too_deep(why: str) -> JSONResponse:
    return JSONResponse({"error": {
        "message": f"request body is {why}; send JSON nested at most {MAX_JSON_DEPTH} levels",
        "type": "invalid_request_error", "param": "body", "code": 400}}, status_code=400)


def json_too_deep(raw: bytes) -> str | None:
    """Why a JSON body is too deeply nested, or None. Any route, before any handler parses it:
    200,000 opening brackets made the router's parser raise RecursionError (a 500). A body with
    at most MAX_JSON_DEPTH brackets cannot be deeper; otherwise it is parsed (C speed; the
    parser's own recursion limit ends a bracket flood early) and its containers walked until
    one lies deeper than the limit."""
    head = raw.lstrip()[:1]
    if head not in (b"[", b"{") or raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return None
    try:
        value = json.loads(raw)
    except RecursionError:
        return "nested too deeply to parse"
    except ValueError:
        return None  # not JSON: the route says so in its own words
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nested deeper than {MAX_JSON_DEPTH} levels"
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return None


class BodySizeLimit:
    """POST / PUT / PATCH / DELETE bodies: over the size limit -> 413 (from Content-Length before a byte is
    read, or as a chunked body passes it); JSON nested too deep -> 400. The body is read here
    and replayed to the route."""

    def __init__(self, app: ASGIApp, limit: int | None = None) -> None:
        self.app = app
        self.limit = max_request_bytes() if limit is None else limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _too_large(self.limit)(scope, receive, send)
            return
        # read it all here (the routes read it all anyway), then replay it
        messages: list[Message] = []
        size = 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.limit:
                await _too_large(self.limit)(scope, receive, send)
                return
            if not msg.get("more_body", False):
                break
        why = json_too_deep(b"".join(m.get("body", b"") for m in messages
                                     if m["type"] == "http.request"))
        if why is not None:
            await _too_deep(why)(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _walk(value: Any, path: str, depth: int = 0) -> None:
    """Lone surrogates, 64-bit overflow, non-finite numbers and deep nesting, anywhere."""
    where = path or "body"
    if depth > MAX_DEPTH:
        raise InvalidRequestError(f"{where} is nested deeper than {MAX_DEPTH} levels", where)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"{where} is not valid Unicode: lone surrogate at character {e.start} "
                "(send UTF-8 text; escape pairs must be complete)", where) from None
    elif isinstance(value, bool):
        return
    elif isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise InvalidRequestError(f"{where} does not fit a 64-bit integer", where)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequestError(f"{where} must be a finite number", where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(k, where, depth + 1)
            _walk(v, f"{path}.{k}" if path else k, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _walk(v, f"{where}[{i}]", depth + 1)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(value: Any, limit: int, field: str, what: str = "entries") -> None:
    if isinstance(value, list) and len(value) > limit:
        raise InvalidRequestError(f"{field} has {len(value)} {what}; at most {limit}", field)


def _batch(value: Any) -> Any:
    """`value` when it is a batch of prompts: a list of texts or of token-id lists. A flat list
    of token ids is one prompt, bounded by the context length, not by the batch limit."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return value
    return None


def _short(value: Any, limit: int, field: str) -> None:
    for i, v in enumerate(value if isinstance(value, list) else [value]):
        if isinstance(v, str) and len(v) > limit:
            name = f"{field}[{i}]" if isinstance(value, list) else field
            raise InvalidRequestError(f"{name} has {len(v)} characters; at most {limit}", name)


def _check_stop(obj: dict[str, Any], prefix: str, vocab: int) -> None:
    stop = obj.get("stop")
    _count(stop, MAX_STOP, prefix + "stop", "stop strings")
    _short(stop, MAX_STOP_CHARS, prefix + "stop")
    ids = obj.get("stop_token_ids")
    _count(ids, MAX_STOP_TOKEN_IDS, prefix + "stop_token_ids")
    if isinstance(ids, list) and vocab:
        for t in ids:
            if _int(t) is not None and not 0 <= t < vocab:
                raise InvalidRequestError(f"{prefix}stop_token_ids holds {t}, outside the "
                                          f"vocabulary [0, {vocab})", prefix + "stop_token_ids")


def _check_bias(obj: dict[str, Any], prefix: str, vocab: int) -> None:
    bias = obj.get("logit_bias")
    if not isinstance(bias, dict):
        return
    field = prefix + "logit_bias"
    _count(list(bias), MAX_LOGIT_BIAS_ENTRIES, field)
    for key in bias:
        # isascii: str.isdigit() is also true of "³" and other digits int() refuses
        ok = isinstance(key, str) and 0 < len(key) <= 20 and key.isascii() and key.isdigit()
        if not ok or (vocab and int(key) >= vocab):
            raise InvalidRequestError(f"{field} keys must be token ids in [0, {vocab or 'vocab'})"
                                      f", got {str(key)[:40]!r}", field)


def _check_seed(obj: dict[str, Any], prefix: str) -> None:
    for key in ("seed", "sampling_seed"):
        seed = _int(obj.get(key))
        if seed is not None and not -INT64 <= seed < INT64 - 64:  # sample j uses seed + j
            raise InvalidRequestError(f"{prefix}{key} must be in [-2^63, 2^63 - 64)", prefix + key)


def _check_top(value: Any, cap: int, vocab: int, field: str) -> None:
    limit = min(cap, vocab) if vocab else cap
    for v in value if isinstance(value, list) else [value]:
        if _int(v) is not None and v > limit:
            raise InvalidRequestError(f"{field} must be at most {limit} (the vocabulary has "
                                      f"{vocab or 'unknown'} tokens), got {v}", field)


def _check_text(value: Any, field: str, max_chars: int) -> None:
    """A text so long that even the longest tokens could not fit it in the context is refused
    before tokenising it (1 MB of text takes over a second to tokenise)."""
    if not max_chars:
        return
    for i, v in enumerate(value if isinstance(value, list) else [value]):
        if isinstance(v, str) and len(v) > max_chars:
            name = f"{field}[{i}]" if isinstance(value, list) else field
            raise InvalidRequestError(f"{name} is too long: {len(v)} characters cannot fit the "
                                      "context length; shorten it", name)


def _samples(route: str, body: dict[str, Any]) -> int:
    if route == "/generate":
        sps = body.get("sampling_params")
        ns = [(_int(sp.get("n")) or 1) if isinstance(sp, dict) else 1
              for sp in (sps if isinstance(sps, list) else [sps])]
        text, ids = body.get("text"), body.get("input_ids")
        prompts = len(text) if isinstance(text, list) else (
            len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else 1)
        return sum(ns) if isinstance(sps, list) else ns[0] * prompts
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(
        prompt[0], (str, list)) else 1
    return prompts * (_int(body.get("n")) or 1)


def check_body(route: str, body: dict[str, Any], info: EngineInfo | None,
               max_token_chars: int = 0) -> None:
    """Raise InvalidRequestError for the first field out of bounds. `info` is the engine's
    (vocab_size, context_length, dp_size); None on the router, whose workers check those."""
    info = info or EngineInfo()
    _walk(body, "")
    check_unsupported(route, body)
    vocab, ctx = info.vocab_size, info.context_length
    max_chars = ctx * max_token_chars if ctx and max_token_chars else 0
    for key in ("rid", "model", "user", "bootstrap_host"):
        _short(body.get(key), MAX_NAME_CHARS, key)
    rids = body.get("rid")
    if isinstance(rids, list) and len({r for r in rids if isinstance(r, str)}) < len(rids):
        raise InvalidRequestError("rid holds the same id twice; give every request its own",
                                  "rid")
    timeout = body.get("timeout")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and not (
            0 < timeout <= MAX_TIMEOUT_S):
        raise InvalidRequestError(f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got "
                                  f"{timeout}", "timeout")
    dp = info.dp_size
    # one body goes to both roles: a prefill server's own rank is disagg_prefill_dp_rank, the
    # others name decode's; a decode server cannot know prefill's dp size
    own = (("disagg_prefill_dp_rank",) if info.disaggregation_mode == "prefill" else
           ("routed_dp_rank", "data_parallel_rank"))
    for key in ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"):
        rank = _int(body.get(key))
        if rank is not None and (rank < 0 or (dp and key in own and rank >= dp)):
            raise InvalidRequestError(f"{key} must be in [0, {dp or 'dp_size'}), got {rank}", key)
    if route == "/generate":
        for key in ("text", "input_ids"):
            _count(_batch(body.get(key)), MAX_BATCH, key)
        _count(body.get("rid"), MAX_BATCH, "rid")
        _check_text(body.get("text"), "text", max_chars)
        _check_top(body.get("top_logprobs_num"), MAX_TOP_LOGPROBS_NUM, vocab, "top_logprobs_num")
        for v in (lsl if isinstance(lsl := body.get("logprob_start_len"), list) else [lsl]):
            if _int(v) is not None and v < -1:
                raise InvalidRequestError("logprob_start_len must be -1 (none) or >= 0, got "
                                          f"{v}", "logprob_start_len")
        sps = body.get("sampling_params")
        _count(sps, MAX_BATCH, "sampling_params")
        for i, sp in enumerate(sps if isinstance(sps, list) else [sps]):
            if isinstance(sp, dict):
                prefix = f"sampling_params[{i}]." if isinstance(sps, list) else "sampling_params."
                _check_stop(sp, prefix, vocab)
                _check_seed(sp, prefix)
                _check_bias(sp, prefix, vocab)
    else:
        _check_stop(body, "", vocab)
        _check_seed(body, "")
        _check_bias(body, "", vocab)
        _count(_batch(body.get("prompt")), MAX_BATCH, "prompt")
        _check_text(body.get("prompt"), "prompt", max_chars)
        for key in ("logprobs", "top_logprobs"):
            _check_top(body.get(key), 20, vocab, key)
        items = body.get("input") if route == "/v1/responses" else None  # a text or items
        _count(items, MAX_MESSAGES, "input", "items")
        _check_text(items if isinstance(items, str) else None, "input", max_chars)
        for i, item in enumerate(items if isinstance(items, list) else []):
            content = item.get("content") if isinstance(item, dict) else None
            _count(content, MAX_MESSAGES, f"input[{i}].content", "parts")
            _check_text(content, f"input[{i}].content", max_chars)
        messages = body.get("messages")
        _count(messages, MAX_MESSAGES, "messages", "messages")
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            content = m.get("content") if isinstance(m, dict) else None
            _count(content, MAX_MESSAGES, f"messages[{i}].content", "parts")
            _check_text(content, f"messages[{i}].content", max_chars)
    samples = _samples(route, body)
    if samples > MAX_SAMPLES:
        raise InvalidRequestError(f"this request asks for {samples} samples (prompts x n); at "
                                  f"most {MAX_SAMPLES}", "n")


def max_token_chars(app: FastAPI) -> int:
    """Characters of the longest token of the engine's tokenizer (0 when unknown); cached."""
    cached = getattr(app.state, "limits_max_token_chars", None)
    if cached is not None:
        return int(cached)
    engine = getattr(app.state, "engine", None)
    tok = getattr(engine, "tokenizer", None)
    if tok is None or not getattr(engine, "ready", False):
        return 0
    try:
        longest = max(len(tok.convert_tokens_to_string([t])) for t in tok.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without these methods: no early bound
        longest = 0
    app.state.limits_max_token_chars = longest
    return longest


async def check_request(request: Request) -> None:
    """Dependency of every generate route (see the module doc)."""
    if request.method != "POST" or request.url.path not in GENERATE_ROUTES:
        return
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return  # FastAPI (or the router's proxy) answers for a body that is not JSON
    if not isinstance(body, dict):
        return
    engine = getattr(request.app.state, "engine", None)
    info = getattr(engine, "info", None)
    # the schema's types (strict numbers) first, here too so that the router, which forwards
    # the body as it is, refuses what the servers refuse, with the same message
    try:
        SCHEMAS[request.url.path].model_validate(body)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise InvalidRequestError(message, param) from None
    check_body(request.url.path, body, info, max_token_chars(request.app))


def install_limits(app: FastAPI) -> None:
    """Body-size middleware and the request check on every route added after this call."""
    app.add_middleware(BodySizeLimit)
    app.router.dependencies.append(Depends(check_request))
    if InvalidRequestError not in app.exception_handlers:  # the router has no handler of its own
        async def _invalid(_: Request, exc: Exception) -> JSONResponse:
            field = getattr(exc, "field", None)
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error",
                                           "param": field, "code": 400}}, status_code=400)

        app.add_exception_handler(InvalidRequestError, _invalid)
