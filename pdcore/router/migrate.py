"""Request migration: a committed stream whose decode server dies, freezes or drains past its
drain timeout goes on on another (P, D) pair, and its client sees no token missing or repeated.

1. Which streams: `/generate`, `/v1/completions`, `/v1/chat/completions` and `/v1/responses`
   with one prompt and one choice, logprobs or not (`migratable`; not a completions stream
   with both echo and logprobs); several choices: migrate_many.py. What a later leg's events
   need rewritten (native logprob lists, Responses' sequence numbers and ids) is
   migrate_carry.py's. Their body asks D for `pd_stream_ids`: each SSE event comes after a
   comment `: pd-ids 5,17` with the token ids it adds (SSE clients ignore comments; the
   router strips them anyway, so the client's stream is the server's, byte for byte). The router keeps the ids of the events it forwarded: what the client has.
2. When the stream breaks: the connection resets or ends before `[DONE]` (D's process died),
   D sends an error event of its own side (5xx, `draining`: its scheduler died, or the drain
   timeout aborted it), or nothing comes for --migration-stall-secs and D's /health gives no
   200 within --health-check-timeout-secs (frozen: SIGSTOP, a hung host). The worker leaves the
   rotation (its health checks bring it back) and the leg is closed (a live D aborts the
   request and frees its pages).
3. The resume: the same body with `pd_resume_ids` (the ids so far) goes through the proxy's
   attempt loop, retries and all, to a fresh pair: P prefills prompt + ids (its prefix cache
   holds the prompt's pages when it served the first leg), D decodes on. Both servers count
   the resumed ids as output: max_new_tokens, min_new_tokens, stop strings, usage and the
   detokenizer's state run on from them (server/planner.py, server/output.py), and D skips
   what the client already has (a chat stream's opening chunk, text already shown).
4. Sampling: greedy gives the undisturbed run's text. A seeded request continues the seed's
   stream: token k is drawn with the seed's k-th uniform, so the resumed P skips N-1 draws and
   D N (GenerateReq.seed_skip) and the text is the undisturbed run's too. Unseeded sampling
   continues from a fresh random state (as any retry would).
5. A stream moves at most --migration-max times; when no pair can take it (or the resume
   fails otherwise) the client gets the error event it gets today, then `[DONE]` (Responses:
   its `error` and `response.failed` events).

Metrics: `pdrouter_migrations_total{reason,outcome}`, `pdrouter_migration_resume_seconds`
(break seen -> the resumed leg's first event forwarded).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from pdcore.edge.streams import ClosingStreamingResponse, finish
from pdcore.router.migrate_carry import Carry, ResponsesCarry
from pdcore.router.upstream import Deadline, DecodeLeg, UpstreamClients, record, worker_outcome
from pdcore.router.workers import Worker

log = logging.getLogger("pdcore.router.migrate")

LEG_ONLY = "leg"  # the proxy's commit hands back the decode leg of a resume, not a response
ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"})
IDS_PREFIX = b": pd-ids "
DONE = b"data: [DONE]"
# an error event of D's own side (its scheduler died, a drain timed out): the request is fine
MIGRATE_CODES = frozenset({500, 502, 503, "draining", "peer_failed", "peer_restarted"})

# resume(ids) -> the committed decode leg of a fresh pair, or the error body the client gets
Resume = Callable[[list[int]], Awaitable["DecodeLeg | bytes"]]


def migratable(route: str, body: dict[str, Any], n: int | None, stream: bool,
               logprobs: bool, max_moves: int) -> bool:
    """A stream of one output the router can move (module doc, point 1)."""
    if not stream or n is not None or max_moves <= 0 or route not in ROUTES:
        return False
    if logprobs and route == "/v1/completions" and body.get("echo"):
        return False  # its first chunk is P's prompt logprobs merged into D's echo chunk
    if body.get("pd_resume_ids") is not None:  # a client's own resume: passed on as it is
        return False
    return body.get("n", 1) in (1, None)


class Broken(Exception):
    """The decode leg stopped before its stream ended; `reason` labels the metric."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _finished(obj: Any) -> bool:
    """An event that ends the output (its finish_reason is set)."""
    if not isinstance(obj, dict):
        return False
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and meta.get("finish_reason") is not None:
        return True
    return any(isinstance(c, dict) and c.get("finish_reason") is not None
               for c in obj.get("choices") or [])


def _error_code(obj: Any) -> object:
    err = obj.get("error") if isinstance(obj, dict) else None
    return err.get("code") if isinstance(err, dict) else None


RESPONSES_END = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _responses_event(obj: Any) -> tuple[bool, bool]:
    """/v1/responses: (an error of the server's side, the stream's last event)."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    return kind == "error" and obj.get("code") == "server_error", kind in RESPONSES_END


class StreamCursor:
    """What the client has of one stream: the ids of the events forwarded, whether the output
    finished and whether `[DONE]` went out. `feed` splits bytes into whole events, strips the
    id comments, and raises Broken at an error event of D's side (not forwarded)."""

    def __init__(self, responses: bool = False, n: int = 1) -> None:
        self.responses = responses  # /v1/responses: its own end and error events, no [DONE]
        self.ids: list[int] = []
        # n > 1 choices (migrate_many.py): each event is one choice's; its ids and whether
        # it ended, by choice index; `finished` once every choice ended
        self.n = n
        self.by_index: dict[int, list[int]] = {}
        self.ended: set[int] = set()
        self.finished = False
        self.done = False
        # an event came without its ids (a server that does not mark them: not pdserve's):
        # the stream cannot move, its client's position is unknown
        self.unmarked = False
        self._buf = b""

    def reset(self) -> None:
        """A new leg: a partial event of the last one is dropped (its ids were not counted)."""
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        self._buf += data.replace(b"\r\n", b"\n")
        out = []
        while (cut := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[:cut], self._buf[cut + 2:]
            kept = self._event(event)
            if kept:
                out.append(kept + b"\n\n")
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        ids: list[int] = []
        lines, marked, data = [], False, False
        for line in event.split(b"\n"):
            if line.startswith(IDS_PREFIX):
                marked = True
                text = line[len(IDS_PREFIX):].strip()
                ids.extend(int(t) for t in text.split(b",") if t)
            else:
                lines.append(line)
        kept = b"\n".join(lines)
        for line in lines:
            if line.strip() == DONE:
                self.done = True
            elif line.startswith(b"data:"):
                try:
                    obj = json.loads(line[5:])
                except ValueError:
                    continue
                data = True
                code = _error_code(obj)
                ours, last = _responses_event(obj) if self.responses else (False, False)
                if (ours or (code is not None and code in MIGRATE_CODES)) and not self.finished:
                    raise Broken("error_event", f"decode sent an error event: "
                                 f"{line[5:].strip()[:300].decode('utf-8', 'replace')}")
                if self.n > 1:
                    self._choice(obj, ids)
                else:
                    self.finished = self.finished or _finished(obj) or last
                self.done = self.done or last
        self.ids.extend(ids)
        self.unmarked = self.unmarked or (data and not marked and not self.finished)
        return kept


    def _choice(self, obj: Any, ids: list[int]) -> None:
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or \
                not isinstance(choices[0], dict) or not isinstance(choices[0].get("index"), int):
            if ids:  # ids of no one choice: this client's position is unknown
                self.unmarked = True
            return
        idx = choices[0]["index"]
        self.by_index.setdefault(idx, []).extend(ids)
        if choices[0].get("finish_reason") is not None:
            self.ended.add(idx)
            self.finished = len(self.ended) >= self.n


def error_event(message: str, code: str = "decode_stream_error") -> bytes:
    return b"data: " + json.dumps({"error": {"code": code, "message": message}}).encode() + \
        b"\n\n"


class Prober:
    """Whether a decode server lives: its /health answers at all within `probe_s` (503 while it
    drains: it still streams what it holds). One probe per worker at a time, its answer shared
    by every request that waits on it for `stall_s / 2`."""

    def __init__(self, clients: UpstreamClients, *, stall_s: float, probe_s: float) -> None:
        self._clients = clients
        self.stall_s, self.probe_s = stall_s, probe_s
        self._last: dict[str, tuple[float, asyncio.Task[bool]]] = {}

    async def alive(self, worker: Worker) -> bool:
        now = asyncio.get_running_loop().time()
        last = self._last.get(worker.url)
        if last is None or (last[1].done() and now - last[0] > self.stall_s / 2):
            last = (now, asyncio.get_running_loop().create_task(self._probe(worker)))
            self._last[worker.url] = last
        return await asyncio.shield(last[1])

    async def _probe(self, worker: Worker) -> bool:
        try:
            await self._clients.get(worker).get(worker.url + "/health", timeout=self.probe_s)
        except httpx.HTTPError:
            return False
        return True  # any answer: the process runs (a frozen one answers nothing)

    async def frozen(self, worker: Worker) -> None:
        """Returns once the worker stops answering (a request waiting on it before commit:
        the proxy then retries the whole request elsewhere)."""
        while True:
            await asyncio.sleep(self.stall_s)
            if not await self.alive(worker):
                log.warning("decode worker %s gives no /health answer within %g s: frozen",
                            worker.url, self.probe_s)
                out_of_rotation(worker)
                return


def out_of_rotation(worker: Worker) -> None:
    """Until its /health is 200 again (the health checks bring it back)."""
    worker.healthy = False
    worker.health_successes = 0


class Migration:
    """One migratable stream: forwards its legs' events and moves it when a leg breaks."""

    def __init__(self, resume: Resume, prober: Prober, metrics: Any, deadline: Deadline,
                 *, max_moves: int, carry: Carry | None = None) -> None:
        self._resume = resume
        self._prober = prober
        self._metrics = metrics
        self._deadline = deadline
        self._max_moves = max_moves
        self._stall_s = prober.stall_s
        self.leg: DecodeLeg | None = None
        self.cursor = StreamCursor(responses=isinstance(carry, ResponsesCarry))
        self.moves = 0
        self._carry = carry

    async def release(self) -> None:
        if self.leg is not None:
            await self.leg.release()

    async def stream(self, leg: DecodeLeg | None, merger: Any = None, *,
                     broke: tuple[str, str] = ("", "")) -> AsyncIterator[bytes]:
        """The client's bytes; `merger` (merge.SSEMerger: P's prompt logprobs of the first leg)
        rewrites every leg's events. No `leg`: the stream starts by moving (one choice of a
        stream of several, migrate_many.py), `broke` says why (reason, message)."""
        self.leg = leg
        cur = self.cursor
        broke_at: float | None = None
        reason, message = broke
        while True:
            if self.leg is not None:
                try:
                    async for chunk in self._chunks(self.leg):
                        out = cur.feed(chunk)
                        if out and self._carry is not None:
                            out = self._carry.feed(out)
                        if out and merger is not None:
                            out = merger.feed(out)
                        if out:
                            if broke_at is not None:
                                self._metrics.migration_resumed(time.monotonic() - broke_at)
                                broke_at = None
                            yield out
                    if cur.done:
                        return
                    raise Broken("broken", f"decode stream from {self.leg.worker.url} ended "
                                 "before [DONE]")
                except (httpx.HTTPError, Broken) as exc:
                    reason = exc.reason if isinstance(exc, Broken) else "broken"
                    message = f"decode stream from {self.leg.worker.url} broke: " + (
                        str(exc) if isinstance(exc, Broken) else f"{type(exc).__name__}: {exc}")
                    if reason != "deadline":
                        self._lost(self.leg, exc)
            if cur.finished:  # the output is complete: only [DONE] (and usage) was missing
                if not cur.responses:
                    yield DONE + b"\n\n"
                return
            if cur.unmarked or self.moves >= self._max_moves or self._deadline.left() <= 0:
                self._metrics.migration(reason, "gave_up")
                log.warning("%s; not moved (%d moves made)", message, self.moves)
                yield self._error(message)
                return
            self.moves += 1
            broke_at = time.monotonic()
            if self.leg is not None:
                await self.leg.release()
            split = self._split(reason, message)
            if split is not None:  # several choices: each moves on its own
                async for out in split:
                    yield out
                return
            log.warning("%s; moving the stream (%d tokens streamed, move %d)", message,
                        len(cur.ids), self.moves)
            got = await self._resume(list(cur.ids))
            if not isinstance(got, DecodeLeg):
                self._metrics.migration(reason, "failed")
                log.warning("moving the stream failed: %s", got[:300].decode("utf-8", "replace"))
                yield self._error(f"{message}; no server could take it over: "
                                  f"{_message_of(got)}")
                return
            self._metrics.migration(reason, "resumed")
            cur.reset()
            if self._carry is not None:
                self._carry.new_leg()
            self.leg = got

    def _split(self, reason: str, message: str) -> AsyncIterator[bytes] | None:
        """One output: it moves whole (migrate_many.py splits a stream of several)."""
        return None

    def _error(self, message: str) -> bytes:
        """How a stream that cannot go on ends: the route's error event(s) (then `[DONE]`)."""
        if isinstance(self._carry, ResponsesCarry):
            return self._carry.failed(message)
        return error_event(message) + DONE + b"\n\n"

    def _lost(self, leg: DecodeLeg, exc: BaseException) -> None:
        """The worker failed this stream: count it, and out of rotation until its /health is
        200 again (health checks), so the resume goes elsewhere."""
        w = leg.worker
        outcome = worker_outcome(None, False, self._deadline)
        record(w, outcome, self._metrics, "timeout")
        if outcome is not None:
            self._metrics.worker_error("decode", "stream")
        if w.healthy:
            log.warning("decode worker %s lost a stream (%s): out of rotation until its /health "
                        "is 200", w.url, type(exc).__name__)
        out_of_rotation(w)

    async def _chunks(self, leg: DecodeLeg) -> AsyncIterator[bytes]:
        """The leg's bytes; Broken when it stalls and its server does not answer /health."""
        it = leg.raw()
        nxt: asyncio.Future[bytes] | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(anext(it, b""))  # type: ignore[arg-type]
                while True:
                    done, _ = await asyncio.wait({nxt}, timeout=self._stall_s)
                    if done:
                        break
                    if self._deadline.left() <= 0:
                        raise Broken("deadline", "request deadline passed while streaming")
                    if not await self._prober.alive(leg.worker):
                        raise Broken("stalled", f"no byte for {self._stall_s:g} s and no "
                                     f"/health answer within {self._prober.probe_s:g} s")
                chunk = nxt.result()
                if not chunk:
                    return
                yield chunk
        finally:  # the read stopped first, then the generator closed (not while it runs)
            await finish(_stop_reading(nxt, it))


async def _stop_reading(nxt: asyncio.Future[bytes] | None, it: AsyncIterator[bytes]) -> None:
    if nxt is not None and not nxt.done():
        nxt.cancel()
        await asyncio.gather(nxt, return_exceptions=True)
    await it.aclose()  # type: ignore[attr-defined]


class LegResponse(ClosingStreamingResponse):
    """Streaming response that closes its stream and gives the decode leg (or a Migration's
    legs) back however the send ends."""

    def __init__(self, content: AsyncIterator[bytes], leg: DecodeLeg | Migration,
                 **kwargs: object) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self._leg = leg

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            await finish(self._leg.release())


def _message_of(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message")) if isinstance(err, dict) else body[:300].decode()
    except (ValueError, AttributeError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace")
