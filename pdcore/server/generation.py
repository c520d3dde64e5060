"""Runs the scheduler requests of one HTTP call and merges their progress.

1. each item (one prompt x one sample) runs as a task: engine.generate -> OutputAssembler;
2. every scheduler message becomes an Event (index, assembler) on one queue, in arrival order;
3. a stop string / stop id ending an item early closes its generator, which aborts it in the
   scheduler; an error ends the item with an Event carrying the EngineError;
4. when the consumer leaves (client gone, error elsewhere) every task is cancelled, which
   aborts the scheduler requests still running, so their KV pages are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from pdcore.edge import tracing
from pdcore.messages.io import GenerateReq
from pdcore.runtime import EngineError, EngineHandle
from pdcore.server.metrics import ServerMetrics
from pdcore.server.output import OutputAssembler

T = TypeVar("T")


@dataclass
class Item:
    index: int
    req: GenerateReq
    # not sent: this item repeats item `copy_of`'s events (a prefill server makes one request
    # per prompt and answers it n times, so routers merging by index line up)
    copy_of: int | None = None
    # the client asked for 0 new tokens (planner.max_new_tokens): the scheduler makes one,
    # which the answer leaves out
    discard: bool = False
    # a migrated request's output so far (the prompt's last tokens, GenerateReq.resumed): the
    # assembler starts with them, so text, ids, counts and stop strings run on from there
    resumed: list[int] = field(default_factory=list)


@dataclass
class Event:
    index: int
    asm: OutputAssembler
    error: EngineError | None = None
    done: bool = False


class ClientDisconnected(Exception):
    pass


_SPAN = {"prefill": "prefill", "decode": "decode"}  # else "generate" (unified)


async def _run_one(engine: EngineHandle, item: Item, q: asyncio.Queue[Event | int],
                   metrics: ServerMetrics, timeout: float | None) -> None:
    mode = getattr(engine.args, "disaggregation_mode", "null")
    route = item.req.route
    attrs = {"pdserve.rid": item.req.rid, "pdserve.role": mode,
             "pdserve.bootstrap_room": getattr(route, "room", None)}
    with tracing.span(_SPAN.get(mode, "generate"), attrs):  # --enable-trace
        await _run_traced(engine, item, q, metrics, timeout, mode == "decode")


async def _run_traced(engine: EngineHandle, item: Item, q: asyncio.Queue[Event | int],
                      metrics: ServerMetrics, timeout: float | None, decode: bool) -> None:
    req = item.req
    submitted_ns = time.time_ns()
    prompt = req.input_ids[:len(req.input_ids) - len(item.resumed)]
    asm = OutputAssembler(engine.tokenizer, req.rid, prompt, req.sampling, item.discard)
    asm.resume(item.resumed)
    start = time.monotonic()
    last: float | None = None
    # --stream-interval N: an event (a streamed chunk) for the first token, then every N
    interval, sent = max(1, int(getattr(engine.args, "stream_interval", 1) or 1)), -1
    try:
        async with contextlib.aclosing(engine.generate(req, timeout)) as gen:
            async for msg in gen:
                before = len(asm.out.output_ids)
                done = asm.feed(msg)
                new = len(asm.out.output_ids) - before
                if new:
                    now = time.monotonic()
                    if last is None:
                        metrics.ttft.observe(now - start)
                        if decode:  # the first token comes with the KV P sent
                            tracing.child("kv_transfer", submitted_ns, time.time_ns(),
                                          {"pdserve.rid": req.rid})
                    else:  # one observation per token, as SGLang counts them
                        for _ in range(new):
                            metrics.itl.observe((now - last) / new)
                    last = now
                    metrics.generation_tokens.inc(new)
                count = len(asm.out.output_ids)
                # interval 1: every message, as always; else the first token at once
                if interval == 1 or done or sent < 1 or count - sent >= interval:
                    sent = count
                    q.put_nowait(Event(item.index, asm, done=done))
                if done:
                    break
        metrics.prompt_tokens.inc(asm.out.prompt_tokens)
        metrics.cached_tokens.inc(asm.out.cached_tokens)
        metrics.e2e.observe(time.monotonic() - start)
        metrics.finished.inc()
    except EngineError as e:
        q.put_nowait(Event(item.index, asm, error=e, done=True))
    finally:
        q.put_nowait(item.index)


async def run_items(engine: EngineHandle, items: list[Item], metrics: ServerMetrics,
                    timeout: float | None = None) -> AsyncIterator[Event]:
    """Yield Events of all items until each is finished or failed."""
    q: asyncio.Queue[Event | int] = asyncio.Queue()
    sent = [it for it in items if it.copy_of is None]
    copies: dict[int, list[int]] = {}
    for it in items:
        if it.copy_of is not None:
            copies.setdefault(it.copy_of, []).append(it.index)
    tasks = [asyncio.create_task(_run_one(engine, it, q, metrics, timeout)) for it in sent]
    metrics.in_flight.inc(len(sent))
    try:
        remaining = len(sent)
        while remaining:
            ev = await q.get()
            if isinstance(ev, int):
                remaining -= 1
                continue
            yield ev
            for i in copies.get(ev.index, ()):
                yield Event(i, ev.asm, ev.error, ev.done)
    finally:
        metrics.in_flight.dec(len(sent))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(engine: EngineHandle, items: list[Item], metrics: ServerMetrics,
                  timeout: float | None = None) -> list[OutputAssembler]:
    """Run to completion; the first error aborts the rest and is raised."""
    done: dict[int, OutputAssembler] = {}
    async with contextlib.aclosing(run_items(engine, items, metrics, timeout)) as events:
        async for ev in events:
            if ev.error is not None:
                raise ev.error
            if ev.done:
                done[ev.index] = ev.asm
    return [done[it.index] for it in items]


async def _until_disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


def mark_engine_reached(request: Request) -> None:
    """From here on an error of this request may be the engine's (http_errors: a 5xx raised
    before this is marked as the client's doing)."""
    request.state.engine_reached = True


def engine_reached(request: Request) -> bool:
    return bool(getattr(request.state, "engine_reached", False))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its scheduler requests) if the client
    goes away first. `work` is the engine's: the request has reached it."""
    mark_engine_reached(request)
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def ids_comment(asm: OutputAssembler, sent: dict[int, int], index: int) -> bytes:
    """The SSE comment with the token ids an event carries that the last one did not
    (`pd_stream_ids`: pdserve's router reads and strips it to migrate the stream; other SSE
    clients ignore comments). `sent[index]`: ids reported so far (from the resumed output on)."""
    ids = asm.out.output_ids
    start = sent.get(index, asm.resumed)
    sent[index] = len(ids)
    return b": pd-ids " + ",".join(map(str, ids[start:])).encode() + b"\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
