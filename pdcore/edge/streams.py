"""Streamed responses whose clean-up always runs to its end.

Starlette streams a response in a task of its own and, when the client goes away, cancels that
task through an anyio cancel scope, which cancels it again at every later await until it leaves
the scope. An `await` in a `finally` block there (closing the upstream connection, aborting the
engine request) is cut short at its first suspension, and what it was closing stays open: a
decode leg kept generating to max_tokens for a client long gone (CI of a8ab52a). Two tools:

- `finish(aw)`: awaits `aw` in a task of its own behind `asyncio.shield`, so the clean-up runs
  to its end even when the caller is cancelled meanwhile (the caller still sees the cancel).
- `ClosingStreamingResponse`: closes its body iterator, through `finish`, however the send ends,
  so the generator's own `finally` (engine abort, upstream close) runs now, not whenever the
  garbage collector reaches a frame cycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse

T = TypeVar("T")
_FINISHING: set[asyncio.Future[Any]] = set()  # a task nobody references may be collected


async def finish(aw: Awaitable[T]) -> T:
    """`await aw`, run to its end even if this caller is cancelled meanwhile."""
    task = asyncio.ensure_future(aw)
    _FINISHING.add(task)
    task.add_done_callback(_FINISHING.discard)
    return await asyncio.shield(task)


async def close_iterator(it: object) -> None:
    """aclose() an async generator/iterator that has one (a no-op otherwise)."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await finish(aclose())


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse whose body iterator is closed however the send ends."""

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_iterator(self.body_iterator)
