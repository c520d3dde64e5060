"""router/migrate.py without servers: which streams move, and what the cursor keeps of one
(the ids of the events forwarded, comments stripped, D's own error events caught)."""

from __future__ import annotations

import json

import pytest

from pdcore.router.migrate import Broken, StreamCursor, migratable


def _ev(obj: object, ids: list[int] | None = None) -> bytes:
    head = b": pd-ids " + ",".join(map(str, ids)).encode() + b"\n" if ids is not None else b""
    return head + b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_which_streams_move() -> None:
    assert migratable("/generate", {}, None, True, False, 3)
    assert migratable("/v1/chat/completions", {"n": 1}, None, True, False, 3)
    assert not migratable("/generate", {}, None, False, False, 3)  # retried whole instead
    assert not migratable("/generate", {}, 2, True, False, 3)  # a batch
    assert not migratable("/v1/completions", {"n": 2}, None, True, False, 3)
    assert migratable("/generate", {}, None, True, True, 3)  # logprobs
    assert migratable("/v1/completions", {}, None, True, True, 3)
    assert not migratable("/v1/completions", {"echo": True}, None, True, True, 3)
    assert not migratable("/generate", {}, None, True, False, 0)  # --migration-max 0
    assert migratable("/v1/responses", {}, None, True, False, 3)
    assert not migratable("/generate", {"pd_resume_ids": [1]}, None, True, False, 3)


def test_cursor_strips_ids_and_counts_only_whole_events() -> None:
    cur = StreamCursor()
    a = _ev({"text": "a", "output_ids": [5], "meta_info": {"finish_reason": None}}, [5])
    b = _ev({"text": "ab", "output_ids": [5, 6], "meta_info": {"finish_reason": None}}, [6])
    out = cur.feed(a + b[:10])
    assert b"pd-ids" not in out and out == a.split(b"\n", 1)[1]
    assert cur.ids == [5]  # the half event is not the client's yet
    cur.reset()  # the leg broke: its half event is dropped
    out = cur.feed(b"\r\n".join(b.split(b"\n")))  # CRLF events too
    assert cur.ids == [5, 6] and b"pd-ids" not in out
    fin = _ev({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, [])
    cur.feed(fin + b"data: [DONE]\n\n")
    assert cur.finished and cur.done


@pytest.mark.parametrize("code", [500, 503, "draining"])
def test_cursor_catches_the_servers_own_error_events(code: object) -> None:
    cur = StreamCursor()
    cur.feed(_ev({"text": "a", "meta_info": {"finish_reason": None}}, [3]))
    with pytest.raises(Broken):
        cur.feed(_ev({"error": {"message": "engine died", "code": code}}))
    assert cur.ids == [3]


def test_cursor_passes_the_clients_own_errors() -> None:
    cur = StreamCursor()
    out = cur.feed(_ev({"error": {"message": "timeout", "code": 504}}))
    assert b"timeout" in out  # the request's own timeout: not moved, the client sees it


def test_cursor_knows_a_stream_it_cannot_move() -> None:
    """A server that does not mark its events' ids (not pdserve's): the client's position is
    unknown, so a break ends the stream as before instead of repeating text."""
    cur = StreamCursor()
    cur.feed(_ev({"choices": [{"index": 0, "delta": {"role": "assistant"},
                               "finish_reason": None}]}, []))
    assert not cur.unmarked  # an empty mark: an event that adds no token
    cur.feed(_ev({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}))
    assert cur.unmarked


def test_responses_carry_makes_the_legs_one_stream() -> None:
    """/v1/responses: a resumed leg's events continue the sequence numbers and take the first
    leg's response and item ids; an error of the server's side is a break, its end is the
    stream's end (no [DONE])."""
    import json

    from pdcore.router.migrate_carry import ResponsesCarry

    def ev(kind: str, **data: object) -> bytes:
        return (f"event: {kind}\ndata: " + json.dumps({"type": kind, **data}) +
                "\n\n").encode()

    carry, cur = ResponsesCarry(), StreamCursor(responses=True)
    first = (b": pd-ids \n" + ev("response.created", sequence_number=0,
                                  response={"id": "resp_1", "created_at": 5, "output": []})
             + b": pd-ids \n" + ev("response.output_item.added", sequence_number=1,
                                    output_index=0, item={"id": "msg_1", "type": "message"})
             + b": pd-ids 7,8\n" + ev("response.output_text.delta", sequence_number=2,
                                      item_id="msg_1", output_index=0, delta="ab"))
    out = carry.feed(cur.feed(first))
    assert out.count(b"event:") == 3 and cur.ids == [7, 8] and not cur.done
    with pytest.raises(Broken):
        cur.feed(b": pd-ids \n" + ev("error", sequence_number=3, code="server_error",
                                      message="draining"))
    carry.new_leg()
    cur.reset()
    second = (b": pd-ids 9\n" + ev("response.output_text.delta", sequence_number=4,
                                    item_id="msg_2", output_index=0, delta="c")
              + b": pd-ids \n" + ev("response.incomplete", sequence_number=7, response={
                  "id": "resp_2", "created_at": 6, "output": [{"id": "msg_2"}]}))
    got = [json.loads(line[5:]) for line in carry.feed(cur.feed(second)).split(b"\n")
           if line.startswith(b"data:")]
    assert [g["sequence_number"] for g in got] == [3, 4]
    assert got[0]["item_id"] == "msg_1" and got[1]["response"]["id"] == "resp_1"
    assert got[1]["response"]["created_at"] == 5 and got[1]["response"]["output"][0]["id"] \
        == "msg_1"
    assert cur.done and cur.finished and cur.ids == [7, 8, 9]
    end = [json.loads(line[5:]) for line in carry.failed("gone").split(b"\n")
           if line.startswith(b"data:")]
    assert [e["type"] for e in end] == ["error", "response.failed"]
    assert end[1]["response"]["id"] == "resp_1" and end[1]["sequence_number"] == 6


def test_logprob_carry_puts_what_the_client_has_first() -> None:
    import json

    from pdcore.router.migrate_carry import LogprobCarry

    def ev(lps: list) -> bytes:
        return b"data: " + json.dumps({"meta_info": {"output_token_logprobs": lps,
                                                     "input_token_logprobs": []}}).encode() + \
            b"\n\n"

    carry = LogprobCarry()
    assert carry.feed(ev([[-1, 5]]) + ev([[-1, 5], [-2, 6]])) == ev([[-1, 5]]) + ev(
        [[-1, 5], [-2, 6]])
    carry.new_leg()
    got = json.loads(carry.feed(ev([[-3, 7]]))[5:])
    assert got["meta_info"]["output_token_logprobs"] == [[-1, 5], [-2, 6], [-3, 7]]
    carry.new_leg()  # a second move keeps all of it
    got = json.loads(carry.feed(ev([[-4, 8]]))[5:])
    assert [t for _, t in got["meta_info"]["output_token_logprobs"]] == [5, 6, 7, 8]


def test_several_choices_are_tracked_and_resumed_one_by_one() -> None:
    """n > 1 (migrate_many.py): the cursor keeps each choice's ids and end; a choice resumes
    as a request of its own (n 1, seed + index); its chunks get their index back, its usage
    chunk and [DONE] are held back."""
    import json

    from pdcore.router.migrate_many import ChoiceCarry, many_migratable, resume_body

    def chunk(i: int, text: str, reason: str | None = None) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": i, "delta": {"content": text},
                                                    "finish_reason": reason}]}).encode()

    cur = StreamCursor(n=2)
    cur.feed(b": pd-ids \n" + b"data: " + json.dumps({"choices": [
        {"index": 0, "delta": {"role": "assistant"}}, {"index": 1, "delta": {}}]}).encode()
        + b"\n\n" + b": pd-ids 4,5\n" + chunk(1, "ab") + b"\n\n" + b": pd-ids 6\n" +
        chunk(0, "c", "length") + b"\n\n")
    assert cur.by_index == {1: [4, 5], 0: [6]} and cur.ended == {0} and not cur.finished
    cur.feed(b": pd-ids 7\n" + chunk(1, "d", "length") + b"\n\n")
    assert cur.finished and cur.by_index[1] == [4, 5, 7]
    assert not cur.unmarked

    assert many_migratable("/v1/chat/completions", {"n": 2}, True)
    assert many_migratable("/v1/completions", {"n": 3, "prompt": "x"}, False)
    assert not many_migratable("/v1/completions", {"n": 2, "prompt": ["x", "y"]}, False)
    assert not many_migratable("/v1/completions", {"n": 2}, True)  # P's logprobs part
    assert not many_migratable("/v1/chat/completions", {"n": 1}, False)
    assert not many_migratable("/generate", {"n": 2}, False)
    assert not many_migratable("/v1/chat/completions", {
        "n": 2, "stream_options": {"continuous_usage_stats": True}}, False)
    assert resume_body({"n": 3, "seed": 10, "x": 1}, 2, [9]) == {
        "n": 1, "seed": 12, "x": 1, "pd_resume_ids": [9]}
    assert "seed" not in resume_body({"n": 3}, 2, [9])

    carry = ChoiceCarry(1)
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}
    out = carry.feed(chunk(0, "e") + b"\n\n" + b"data: " + json.dumps(usage).encode() +
                     b"\n\n" + b"data: [DONE]\n\n")
    assert json.loads(out[5:])["choices"][0]["index"] == 1 and out.count(b"data:") == 1
    assert carry.usage == usage
