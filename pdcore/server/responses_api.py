"""OpenAI's Responses API on top of the chat route's machinery (#45 item 7).

- `chat_request`: a `/v1/responses` body -> the ChatCompletionRequest it means: `instructions`
  as the system message, `input` (a text, or message / function_call / function_call_output
  items) as the messages, function `tools` and `tool_choice` in the chat form, `text.format` as
  `response_format`, `max_output_tokens` as `max_completion_tokens`, `reasoning.effort` as
  the template's `reasoning_effort`. The chat route's checks, tool planning, template and
  sampling then apply unchanged (and its PD fields: the router routes this route as the others).
- `ResponseBuilder`: the Response object and its output items (reasoning, message,
  function_call) from the chat shaper's message fields, whole or as the Responses stream's
  events (response.created ... response.completed), which add up to the whole.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import ValidationError

from pdcore.edge.schemas import ChatCompletionRequest, ResponsesRequest, validation_message
from pdcore.server.params import bad

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# the Responses fields that the chat request carries under another name (or not at all)
_OWN = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
        "reasoning", "metadata", "parallel_tool_calls", "store", "include", "truncation",
        "service_tier", "previous_response_id", "background", "top_logprobs", "prompt"}


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{field} must be a text or a list of text parts", field)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{field}[{j}]: only text parts are served (input_text, output_text), got "
                      f"{kind!r}", f"{field}[{j}].type")
        out.append(part["text"])
    return "".join(out)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*msgs, {"role": "user", "content": body.input}]
    if not body.input:
        raise bad("input must not be empty", "input")
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad(f"{where}.role must be user, system, developer or assistant, got "
                          f"{item.get('role')!r}", f"{where}.role")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # one turn's parallel calls: one message
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id must be a string", f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: chat templates leave it out too
        else:
            raise bad(f"{where}.type {kind!r} is not served (message, function_call, "
                      "function_call_output, reasoning)", f"{where}.type")
    return msgs


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad(f"tools[{i}].type {t.get('type')!r} is not served (function tools only)",
                      f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", '
              '"name": ...}', "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt  # text / json_object as the chat route reads them (others: its 400)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.n != 1:
        raise bad(f"n must be 1 on /v1/responses, got {body.n}", "n")
    if body.response_format is not None:
        raise bad('response_format is text {"format": ...} on /v1/responses', "response_format")
    effort = (body.reasoning or {}).get("effort")
    fields = {k: v for k, v in body.model_dump().items() if k not in _OWN}
    fields.update(messages=_messages(body), max_completion_tokens=body.max_output_tokens,
                  tools=_tools(body.tools), tool_choice=_tool_choice(body.tool_choice),
                  parallel_tool_calls=body.parallel_tool_calls,
                  response_format=_response_format(body.text), reasoning_effort=effort)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise bad(message, param or "input") from e


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response's object and, streamed, its events in order (sequence_number counts)."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str) -> None:
        self.body, self.id, self.model = body, rid, model
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item a stream is filling
        self.calls: dict[int, dict[str, Any]] = {}  # streamed tool call index -> its item

    # ---- the object ----------------------------------------------------------------------------
    def response(self, status: str, usage: dict[str, Any] | None = None,
                 reason: str | None = None, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": incomplete, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": [dict(i) for i in self.output],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": (b.reasoning or {}).get(
                "effort"), "summary": None},
            "store": False, "temperature": b.temperature, "top_p": b.top_p,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "truncation": "disabled", "usage": usage, "metadata": b.metadata or {},
            "user": b.user,
        }

    @staticmethod
    def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}

    @staticmethod
    def status_of(reason: str | None) -> str:
        return "incomplete" if reason == "length" else "completed"

    def whole(self, message: dict[str, Any]) -> None:
        """The output items of the chat shaper's whole message."""
        if message.get("reasoning_content"):
            self.output.append(self._reasoning(message["reasoning_content"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            self.output.append(self._message(message.get("content") or "", "completed"))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            self.output.append(self._call(call["id"], fn["name"], fn["arguments"], "completed"))

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}]}

    def _reasoning(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": _new_id("rs"), "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _call(self, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    # ---- the stream ----------------------------------------------------------------------------
    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def start(self) -> list[bytes]:
        obj = self.response("in_progress")
        return [self.event("response.created", response=obj),
                self.event("response.in_progress", response=obj)]

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.output.append(item)
        self.open = item
        idx = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=idx, item=dict(item)))
        if item["type"] in ("message", "reasoning"):
            part = dict(item["content"][0])
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=idx, content_index=0, part=part))
        return out

    def close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.output.index(item)
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": idx}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self.event("response.output_text.done", **ids, content_index=0,
                               text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", **ids, content_index=0,
                               part=dict(part))]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += [self.event("response.reasoning_text.done", **ids, content_index=0,
                               text=part["text"]),
                    self.event("response.content_part.done", **ids, content_index=0,
                               part=dict(part))]
        else:
            out.append(self.event("response.function_call_arguments.done", **ids,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=idx, item=dict(item)))
        return out

    def delta(self, fields: dict[str, Any]) -> list[bytes]:
        """Events for one chat delta (reasoning_content, content, tool_calls pieces)."""
        out: list[bytes] = []
        for key, kind in (("reasoning_content", "reasoning"), ("content", "message")):
            piece = fields.get(key)
            if not piece:
                continue
            if self.open is None or self.open["type"] != kind:
                out += self._open(self._reasoning("", "in_progress") if kind == "reasoning"
                                  else self._message("", "in_progress"))
            item = self.open
            assert item is not None
            item["content"][0]["text"] += piece
            ids = {"item_id": item["id"], "output_index": len(self.output) - 1}
            if kind == "message":
                out.append(self.event("response.output_text.delta", **ids, content_index=0,
                                      delta=piece, logprobs=[]))
            else:
                out.append(self.event("response.reasoning_text.delta", **ids, content_index=0,
                                      delta=piece))
        for tc in fields.get("tool_calls") or []:
            fn = tc.get("function") or {}
            item = self.calls.get(tc["index"])
            if item is None:
                item = self._call(tc.get("id") or _new_id("call"), fn.get("name") or "", "",
                                  "in_progress")
                self.calls[tc["index"]] = item
                out += self._open(item)
            piece = fn.get("arguments") or ""
            if piece:
                item["arguments"] += piece
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self.output.index(item),
                                      delta=piece))
        return out

    def finish(self, usage: dict[str, Any], reason: str | None) -> list[bytes]:
        out = self.close()
        status = self.status_of(reason)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*out, self.event(kind, response=self.response(status, usage, reason))]

    def failed(self, message: str, status: int) -> list[bytes]:
        code = "invalid_request" if status < 500 else "server_error"
        err = {"code": code, "message": message}
        return [self.event("error", code=code, message=message, param=None),
                self.event("response.failed", response=self.response("failed", error=err))]
