"""Constrained requests wait here, on the scheduler's rank 0, until their grammar is compiled.

Compiling a grammar can take from microseconds to seconds (a long bounded repetition in a
regex), so it runs on the grammar backend's worker threads (GrammarBackend.prepare) while the
scheduler keeps stepping; the request enters the scheduler, on every TP rank at the same step,
only once its grammar is ready. A grammar that does not compile answers 400 without ever
reaching the scheduler; one still compiling after PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S (30 s)
answers 400 too (a compile already running finishes in the background; one still queued is
cancelled). An abort for a held request ends it here and cancels its queued compile.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pdcore.constrained.backend import GrammarBackend
from pdcore.env import ENV, Env
from pdcore.messages.io import AbortReq, GenerateReq, TokenOut
from pdcore.errors import InvalidRequestError

log = logging.getLogger(__name__)
TIMEOUT_ENV = Env.pdserve_grammar_compile_timeout_s.name
DEFAULT_TIMEOUT_S = Env.pdserve_grammar_compile_timeout_s.default


@dataclass
class _Held:
    req: GenerateReq
    future: Future
    since: float


class GrammarGate:
    def __init__(self, backend: GrammarBackend | None, timeout_s: float | None = None) -> None:
        self.backend = backend
        self.timeout_s = (timeout_s if timeout_s is not None
                          else ENV.pdserve_grammar_compile_timeout_s)
        self.held: list[_Held] = []
        self.timed_out = 0

    @property
    def pending(self) -> bool:
        return bool(self.held)

    def _needs_wait(self, m: Any) -> bool:
        g = m.sampling.grammar if isinstance(m, GenerateReq) else None
        return g is not None and self.backend is not None and not self.backend.ready(g)

    def admit(self, msgs: list[Any]) -> tuple[list[Any], list[TokenOut]]:
        """(messages for the scheduler now, answers for requests that end here)."""
        now = time.monotonic()
        out: list[Any] = []
        ended: list[TokenOut] = []
        for m in msgs:
            if isinstance(m, AbortReq) and any(h.req.rid == m.rid for h in self.held):
                gone = [h for h in self.held if h.req.rid == m.rid]
                self.held = [h for h in self.held if h.req.rid != m.rid]
                for h in gone:
                    self._cancel(h.future)
                    ended += [_aborted(f.rid, m.reason) for f in h.req.forks]
                ended.append(_aborted(m.rid, m.reason))
            elif isinstance(m, AbortReq) and self._drop_fork(m.rid):
                # a parallel sample held inside its sample 0's message (GenerateReq.forks)
                ended.append(_aborted(m.rid, m.reason))
            elif self._needs_wait(m):
                assert self.backend is not None
                try:
                    fut = self.backend.prepare(m.sampling.grammar)
                except InvalidRequestError as e:  # --grammar-backend none
                    ended += _refused(m, str(e))
                    continue
                self.held.append(_Held(m, fut, now))
            else:
                out.append(m)
        still: list[_Held] = []
        dropped: list[Future] = []
        for h in self.held:
            if h.future.cancelled():  # not expected (shared compiles are kept): compile again
                assert self.backend is not None
                h.future = self.backend.prepare(h.req.sampling.grammar)  # type: ignore[arg-type]
                still.append(h)
            elif h.future.done():
                e = h.future.exception()
                if e is None:
                    out.append(h.req)
                elif isinstance(e, InvalidRequestError):
                    ended += _refused(h.req, str(e))
                else:
                    log.error("grammar of %s failed to compile: %r", h.req.rid, e)
                    ended += _refused(h.req, f"grammar failed: {e}", 500)
            elif now - h.since > self.timeout_s:
                self.timed_out += 1
                dropped.append(h.future)
                field = h.req.sampling.grammar.field  # type: ignore[union-attr]
                log.warning("grammar of %s still compiling after %.0fs: refused", h.req.rid,
                            self.timeout_s)
                ended += _refused(h.req, f"{field} took longer than {self.timeout_s:g}s to "
                                  f"compile ({TIMEOUT_ENV}); simplify it")
            else:
                still.append(h)
        self.held = still
        for fut in dropped:
            self._cancel(fut)
        return out, ended

    def _drop_fork(self, rid: str) -> bool:
        for h in self.held:
            kept = [f for f in h.req.forks if f.rid != rid]
            if len(kept) != len(h.req.forks):
                h.req.forks = kept
                return True
        return False

    def _cancel(self, fut: Future) -> None:
        """Cancel a compile that has not started, unless a held request still waits on it
        (the backend shares one compile among requests naming the same grammar)."""
        if not any(h.future is fut for h in self.held):
            fut.cancel()


def _refused(req: GenerateReq, message: str, status: int = 400) -> list[TokenOut]:
    """The answers of a request refused here and of the parallel samples it carries."""
    return [TokenOut(r.rid, [], finished=True, error=message, error_status=status,
                     finish_reason={"type": "abort", "message": message})
            for r in (req, *req.forks)]


def _aborted(rid: str, reason: str) -> TokenOut:
    return TokenOut(rid, [], finished=True, finish_reason={"type": "abort", "message": reason})
