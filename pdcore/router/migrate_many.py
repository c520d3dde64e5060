"""Migration of a stream of several choices (`n` > 1 on /v1/chat/completions and
/v1/completions, one prompt): each choice moves on its own.

1. The first leg streams every choice; D marks each chunk's ids, and each chunk holds one
   choice, so the cursor keeps the ids (and whether it ended) per choice index.
2. When that leg breaks, every choice that has not ended resumes as a request of its own:
   the same body with `n` 1, `pd_resume_ids` the choice's ids, and `seed` + the choice's index
   when seeded (a server gives choice j the seed + j; a seeded choice other than 0 does not
   draw exactly what it would have: docs/migration.md). Each such leg is a Migration of its own (it may move again, within
   --migration-max moves in all for that choice).
3. Their chunks reach the client as they come, with index 0 set back to the choice's index;
   their own `[DONE]` and usage chunks are held back. When every choice is done: one usage
   chunk (when the request asked for it: the prompt's tokens, and the completion tokens of
   every choice counted from the ids), then one `[DONE]`. A choice that no server could take
   over ends with its error event; the others go on.
Not moved (an error event as before): batches of prompts, continuous usage stats (each chunk's
running usage would be one leg's), and completions logprobs (P's part is per request).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pdcore.router.migrate import DONE, Migration, Prober, StreamCursor, migratable
from pdcore.router.migrate_carry import Carry, LogprobCarry, ResponsesCarry
from pdcore.router.upstream import Deadline, DecodeLeg

# resume_one(index, ids) -> the committed leg of choice `index` resumed after `ids`
ResumeOne = Callable[[int, list[int]], Awaitable["DecodeLeg | bytes"]]


def mover(route: str, body: dict[str, Any], n: int | None, stream: bool, logprobs: bool,
          attempt: Callable[[dict[str, Any]], Awaitable[DecodeLeg | bytes]], *,
          prober: Prober, metrics: Any, deadline: Deadline, max_moves: int
          ) -> tuple[dict[str, Any], Migration | None]:
    """The body (asking D for each event's ids) and the Migration of a stream that can move,
    else (body, None). `attempt(body)`: the proxy's attempt loop for a resumed leg."""
    many = stream and max_moves > 0 and many_migratable(route, body, logprobs)
    if not many and not migratable(route, body, n, stream, logprobs, max_moves):
        return body, None
    body = {**body, "pd_stream_ids": True}
    if many:
        return body, ManyMigration(lambda i, ids: attempt(resume_body(body, i, ids)), prober,
                                   metrics, deadline, max_moves=max_moves, n=body["n"])
    carry: Carry | None = LogprobCarry() if logprobs and route == "/generate" else \
        ResponsesCarry() if route == "/v1/responses" else None
    return body, Migration(lambda ids: attempt({**body, "pd_resume_ids": ids}), prober,
                           metrics, deadline, max_moves=max_moves, carry=carry)


def many_migratable(route: str, body: dict[str, Any], logprobs: bool) -> bool:
    """Module doc: which streams of several choices move."""
    n = body.get("n")
    if route not in ("/v1/chat/completions", "/v1/completions") or isinstance(n, bool) or \
            not isinstance(n, int) or n < 2 or body.get("pd_resume_ids") is not None:
        return False
    if route == "/v1/completions" and (logprobs or isinstance(body.get("prompt"), list) and
                                       body["prompt"] and not isinstance(body["prompt"][0],
                                                                         int)):
        return False
    opts = body.get("stream_options")
    return not (isinstance(opts, dict) and opts.get("continuous_usage_stats"))


def resume_body(body: dict[str, Any], index: int, ids: list[int]) -> dict[str, Any]:
    """Choice `index` of `body` as a request of its own, after `ids` (module doc, point 2)."""
    out = {**body, "n": 1, "pd_resume_ids": ids}
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        out["seed"] = seed + index
    return out


class ChoiceCarry:
    """One resumed choice's events as the client's stream has them: index 0 -> `index`;
    `[DONE]` dropped; a usage chunk held back (`usage`)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.usage: dict[str, Any] | None = None

    def feed(self, events: bytes) -> bytes:
        out = []
        for event in events.split(b"\n\n")[:-1]:
            kept = self._event(event)
            if kept:
                out.append(kept + b"\n\n")
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if line.strip() == DONE:
                return b""
            if not line.startswith(b"data:"):
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
                continue
            if not obj["choices"] and isinstance(obj.get("usage"), dict):
                self.usage = obj
                return b""
            for ch in obj["choices"]:
                if isinstance(ch, dict):
                    ch["index"] = self.index
            lines[i] = b"data: " + json.dumps(obj, ensure_ascii=False).encode()
        return b"\n".join(lines)


class ManyMigration(Migration):
    """A stream of several choices (module doc)."""

    def __init__(self, resume_one: ResumeOne, prober: Prober, metrics: Any,
                 deadline: Deadline, *, max_moves: int, n: int) -> None:
        async def whole(ids: list[int]) -> DecodeLeg | bytes:  # never: it splits instead
            raise AssertionError("a stream of several choices moves choice by choice")

        super().__init__(whole, prober, metrics, deadline, max_moves=max_moves)
        self.cursor = StreamCursor(n=n)
        self._resume_one = resume_one
        self._subs: list[Migration] = []

    async def release(self) -> None:
        await super().release()
        for sub in self._subs:
            await sub.release()

    def _split(self, reason: str, message: str) -> AsyncIterator[bytes]:
        return self._choices(reason, message)

    async def _choices(self, reason: str, message: str) -> AsyncIterator[bytes]:
        cur = self.cursor
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        carries: list[ChoiceCarry] = []

        async def one(i: int) -> None:
            sub = Migration(lambda ids: self._resume_one(i, ids), self._prober, self._metrics,
                            self._deadline, max_moves=self._max_moves)
            sub.cursor.ids = list(cur.by_index.get(i, []))  # its ids run on from these
            self._subs.append(sub)
            carry = ChoiceCarry(i)
            carries.append(carry)
            try:
                async for out in sub.stream(None, broke=(reason, f"{message} (choice {i})")):
                    if kept := carry.feed(out):
                        await queue.put(kept)
            finally:
                await queue.put(None)

        todo = [i for i in range(cur.n) if i not in cur.ended]
        tasks = [asyncio.get_running_loop().create_task(one(i)) for i in todo]
        try:
            left = len(tasks)
            while left:
                got = await queue.get()
                if got is None:
                    left -= 1
                else:
                    yield got
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        usage = self._usage(carries)
        if usage is not None:
            yield b"data: " + json.dumps(usage, ensure_ascii=False).encode() + b"\n\n"
        yield DONE + b"\n\n"

    def _usage(self, carries: list[ChoiceCarry]) -> dict[str, Any] | None:
        """One usage chunk for every choice (a resumed leg's counts only its choice)."""
        held = next((c.usage for c in carries if c.usage is not None), None)
        if held is None:
            return None
        cur = self.cursor
        done = sum(len(cur.by_index.get(i, [])) for i in cur.ended) + sum(
            len(sub.cursor.ids) for sub in self._subs)
        usage = dict(held["usage"])
        usage["completion_tokens"] = done
        usage["total_tokens"] = usage.get("prompt_tokens", 0) + done
        return {**held, "usage": usage}
