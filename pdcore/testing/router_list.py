"""A client that knows several routers of one fleet (`pdserve up --routers N`) and falls over
to the next when one does not answer: the client-side way to put routers behind one address
(docs/router.md, Several routers), for tests and benches.

`RouterList(urls).generate(body)`: POST /generate to the first router that takes it. A request
whose router could not be reached, or whose connection broke before the whole answer came (the
router died under it), goes to the next router, from the start (a greedy request answers the
same text; a stream is read again from its first token, and only the last try's text counts).
An HTTP answer, error or not, is the answer: another router would route it to the same servers.
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
    def __init__(self, urls: list[str], timeout: float = 120.0) -> None:
        if not urls:
            raise ValueError("give at least one router URL")
        self.urls = list(urls)
        self.timeout = timeout

    def generate(self, http: httpx.Client, body: dict[str, Any]) -> Outcome:
        last: tuple[str, str] = ("", "")
        for k, url in enumerate(self.urls):
            try:
                status, text = (_stream if body.get("stream") else _plain)(
                    http, url + "/generate", body, self.timeout)
            except httpx.TimeoutException as e:  # a hung router: the answer, not a fall-over
                return Outcome("hung", str(e), url, k)
            except httpx.TransportError as e:  # refused, reset, closed mid-answer: next one
                last = (type(e).__name__, f"{url}: {e}")
                continue
            return Outcome(status, text, url, k)
        return Outcome(last[0], last[1], "", len(self.urls))


def _plain(http: httpx.Client, url: str, body: dict[str, Any],
           timeout: float) -> tuple[int | str, str]:
    r = http.post(url, json=body, timeout=timeout)
    if r.status_code != 200:
        return r.status_code, r.text[:300]
    return 200, r.json()["text"]


def _stream(http: httpx.Client, url: str, body: dict[str, Any],
            timeout: float) -> tuple[int | str, str]:
    with http.stream("POST", url, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode(errors="replace")[:300]
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
                return "sse_error", data[:300]
            text = event.get("text", text)
        if not done:  # the router went away between events: as a broken connection
            raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        return 200, text
