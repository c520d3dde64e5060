"""A client that knows several routers of one fleet (`pdserve up --routers N`) and falls over
to the next when one does not answer: the client-side way to put routers behind one address
(docs/router.md, Several routers), for tests and benches.

`RouterList(urls).generate(http, body)`: POST /generate to the first router that takes it. A
request whose router could not be reached, whose connection broke before the whole answer came
(the router died under it), or that went `stall_s` without a byte (a frozen router: its kernel
still accepts connections) goes to the next router, from the start (a greedy request answers
the same text; a stream is read again from its first token, and only the last try's text
counts). An HTTP answer, error or not, is the answer: another router would route it to the
same servers. When every router failed so: the last failure's name ("hung" for a stall).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Outcome:
    status: int | str  # HTTP status, "sse_error", "no_done", or the last transport error's name
    text: str  # the generated text (or the error's text)
    router: str  # the router that answered ('' when none did)
    fell_over: int  # routers tried before the one that answered


class RouterList:
    def __init__(self, urls: list[str], timeout: float = 120.0,
                 stall_s: float | None = None) -> None:
        if not urls:
            raise ValueError("give at least one router URL")
        self.urls = list(urls)
        # `timeout` bounds each wait; `stall_s` (default: the same) a wait for the next bytes
        self.timeout = httpx.Timeout(timeout, connect=min(5.0, timeout),
                                     read=stall_s or timeout)

    def generate(self, http: httpx.Client, body: dict[str, Any]) -> Outcome:
        last: tuple[str, str] = ("", "")
        for url in self.urls:
            try:
                status, text = (_stream if body.get("stream") else _plain)(
                    http, url + "/generate", body, self.timeout)
            except httpx.TimeoutException as e:  # frozen or unreachable: the next one
                last = ("hung", f"{url}: {type(e).__name__} {e}")
                continue
            except httpx.TransportError as e:  # refused, reset, closed mid-answer: next one
                last = (type(e).__name__, f"{url}: {e}")
                continue
            return Outcome(status, text, url, self.urls.index(url))
        return Outcome(last[0], last[1], "", len(self.urls))


def _plain(http: httpx.Client, url: str, body: dict[str, Any],
           timeout: httpx.Timeout) -> tuple[int | str, str]:
    r = http.post(url, json=body, timeout=timeout)
    if r.status_code != 200:
        return r.status_code, r.text[:300]
    return 200, r.json()["text"]


def read_stream(r: httpx.Response, cut: int = 300) -> tuple[int | str, str]:
    """(status, text) of one opened /generate stream: the HTTP status and body of a refusal,
    ("sse_error", the event) for an error event, ("no_done", the text so far) when the stream
    ended without [DONE], else (200, the final text). `cut`: how much error text to keep."""
    if r.status_code != 200:
        return r.status_code, r.read().decode(errors="replace")[:cut]
    text, done = "", False
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            return "sse_error", data[:cut]
        text = event.get("text", text)
    return (200, text) if done else ("no_done", text)


def _stream(http: httpx.Client, url: str, body: dict[str, Any],
            timeout: httpx.Timeout) -> tuple[int | str, str]:
    with http.stream("POST", url, json=body, timeout=timeout) as r:
        status, text = read_stream(r)
    if status == "no_done":  # the router went away between events: as a broken connection
        raise httpx.RemoteProtocolError("the stream ended without [DONE]")
    return status, text
