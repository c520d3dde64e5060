"""/v1/responses without a server (#45 item 7): a Responses body becomes the chat request it
means, and the stream's events add up to the whole response whatever the pieces (reasoning,
text, tool-call arguments streamed in pieces or at once). The served route, unified and 1P1D
with the official client: tests/pd/test_pd_structured.py."""

from __future__ import annotations

import json

import pytest

from pdcore.errors import InvalidRequestError
from pdcore.server.responses_api import ResponseBuilder, chat_request
from pdcore.edge.schemas import ResponsesRequest


def _body(**kw: object) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **kw})


def test_input_items_become_the_conversation() -> None:
    chat = chat_request(_body(instructions="Be brief.", max_output_tokens=7, input=[
        {"role": "developer", "content": "ctx"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}],
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        reasoning={"effort": "low"}, temperature=0.5, seed=3))
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("system", "ctx"), ("user", "ab"),
                     ("assistant", None), ("tool", "one"), ("tool", "two")]
    assert [c["id"] for c in chat.messages[3].tool_calls] == ["c1", "c2"]  # one turn
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.seed == 3
    assert chat.tools == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object"}}}
    assert chat.reasoning_effort == "low"


@pytest.mark.parametrize("kw,param", [
    ({"input": []}, "input"), ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "mcp"}}, "tool_choice"), ({"n": 2}, "n"),
])
def test_what_is_not_served_is_named(kw: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        chat_request(_body(**kw))
    assert e.value.field == param


def _parse(events: list[bytes]) -> list[dict]:
    out = []
    for raw in events:
        head, data = raw.decode().strip().split("\n")
        obj = json.loads(data[len("data: "):])
        assert head == f"event: {obj['type']}"
        out.append(obj)
    return out


def test_streamed_pieces_add_up_to_the_whole() -> None:
    pieces = [{"reasoning_content": "think "}, {"reasoning_content": "more"},
              {"content": "Hel"}, {"content": "lo"},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}},
                              {"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "g", "arguments": "{}"}}]}]
    b = ResponseBuilder(_body(), "resp_1", "m")
    events = b.start()
    for p in pieces:
        events += b.delta(p)
    events += b.finish(ResponseBuilder.usage(3, 9, 0), "stop")
    evs = _parse(events)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["type"] == "response.created" and evs[-1]["type"] == "response.completed"
    added = [e["item"]["type"] for e in evs if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    assert [d["status"] for d in done] == ["completed"] * 4
    final = evs[-1]["response"]
    assert final["output"] == done
    assert done[0]["content"][0]["text"] == "think more"
    assert done[1]["content"][0]["text"] == "Hello" == "".join(
        e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert (done[2]["call_id"], done[2]["name"], done[2]["arguments"]) == ("call_a", "f",
                                                                           '{"x": 1}')
    assert (done[3]["call_id"], done[3]["arguments"]) == ("call_b", "{}")
    # each item's events name it at its own output index, in order
    for e in evs:
        if "output_index" in e and "item_id" in e:
            assert final["output"][e["output_index"]]["id"] == e["item_id"], e


def test_whole_and_incomplete_and_failed() -> None:
    b = ResponseBuilder(_body(max_output_tokens=4), "resp_2", "m")
    b.whole({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    obj = b.response(b.status_of("stop"), ResponseBuilder.usage(1, 2, 0), "stop")
    assert [i["type"] for i in obj["output"]] == ["function_call"]
    b = ResponseBuilder(_body(), "resp_3", "m")
    b.whole({"role": "assistant", "content": ""})
    obj = b.response(b.status_of("length"), None, "length")
    assert obj["status"] == "incomplete"
    assert obj["incomplete_details"] == {"reason": "max_output_tokens"}
    assert obj["output"][0]["content"][0]["text"] == ""
    evs = _parse(ResponseBuilder(_body(), "r", "m").failed("boom", 500))
    assert [e["type"] for e in evs] == ["error", "response.failed"]
    assert evs[1]["response"]["error"] == {"code": "server_error", "message": "boom"}
