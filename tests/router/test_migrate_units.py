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
    assert not migratable("/generate", {}, None, True, True, 3)  # logprobs
    assert not migratable("/generate", {}, None, True, False, 0)  # --migration-max 0
    assert not migratable("/v1/responses", {}, None, True, False, 3)
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
