"""Prefill-side scheduling: P computes nothing for a request until D has reserved room for it.

1. admit: check the request makes one token (the request planner decides that on a prefill
   server; one that asks for more was planned elsewhere and is refused), register the room with
   the KV manager (Bootstrapping) and hold the request in the bootstrap queue;
2. when D's destination pages arrived (WaitingForInput) and an aux slot is free, the request
   joins the normal waiting queue and is prefilled in chunks;
3. after every forward pass, the pages a chunk completed are sent at once; the last chunk
   carries the aux row (first token and its logprobs; with a draft head, its chain start: the
   first draft token and the head's output vector, D's first drafts);
4. the request then waits in the inflight queue, its pages held, until the manager reports
   Success (pages and aux slot freed, HTTP response sent) or Failed (error to the client).

Parallel samples (n > 1) reach P as one request per prompt (the HTTP layer answers it n times):
the prompt's KV crosses once and D forks the samples; `disagg_transfers_per_request` shows it.

Every decision uses poll states agreed by all TP ranks (pdcore.disagg.agree), so each rank's
copy of the schedule moves the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcore.disagg import wire
from pdcore.disagg.agree import Agreed
from pdcore.disagg.aux import MAX_TOP_LOGPROBS, AuxBuffers, AuxRow
from pdcore.disagg.common import FAKE_BOOTSTRAP_HOST
from pdcore.disagg.role import RoleExtension
from pdcore.engine.sched.batch_run import StepResult
from pdcore.engine.sched.request import Phase, Req
from pdcore.engine.sched.scheduler import Scheduler
from pdcore.engine.sched.stats import StatsReport
from pdcore.messages.codes import ErrorCode
from pdcore.messages.stats import queue_key

log = logging.getLogger(__name__)


@dataclass
class PState:
    room: int
    sent_pages: int = 0  # pages D has: its cached prefix, then every chunk sent
    aux_slot: int | None = None
    prefix_pages: int = 0  # of those, the prefix D held already (never sent)
    prompt_digest: str = ""  # wire.prefix_digest of the whole prompt: D's must be the same
    probe: bool = False  # /health_generate's fake room: not counted as a PD request


# votes on D's cached prefix that fail the request (a real vote is a page count >= 0)
_RANKS_DISAGREE, _DIGEST_MISMATCH, _PROMPT_MISMATCH = -1, -2, -3


class PrefillExtension(RoleExtension):
    def __init__(self, sched: Scheduler, mgr: Any, aux: AuxBuffers) -> None:
        super().__init__(sched, mgr, aux, ["requests", "transfers", "prefix_skipped_pages",
                                           "chain_starts_sent", "chain_starts_missing"])
        self.bootstrap: list[Req] = []
        self.inflight: list[Req] = []

    def admit(self, req: Req) -> bool:
        route = req.route
        if route is None or route.room is None:
            self.sched.fail(req, "a prefill server needs bootstrap_room (send requests through "
                                 "the router)", 400)
            return True
        if req.params.max_new_tokens != 1:  # the planner decides 1 on P (server/planner.py)
            self.sched.fail(req, "a prefill server makes one token: this request asks for "
                                 f"{req.params.max_new_tokens} (max_new_tokens), so it was not "
                                 "planned by this server's request planner", 400)
            return True
        if self._duplicate(req, int(route.room)):
            return True
        probe = route.host == FAKE_BOOTSTRAP_HOST
        self._take(req, PState(int(route.room), prompt_digest=wire.prefix_digest(req.prompt),
                               probe=probe))
        self.mgr.add(req.disagg.room, route.host)
        self.bootstrap.append(req)
        self.counts["requests"] += not probe
        return True

    def poll(self) -> None:
        waiting = {r.disagg.room: r for r in self.bootstrap}
        votes: dict[int, int] = {}

        def vote(room: int) -> int:
            # called after this rank polled the room's state (as the page count is): a room
            # seen WaitingForInput has every D rank's TransferInfo, so the vote is final
            if room not in votes:
                req = waiting.get(room)
                votes[room] = self._prefix_vote(req) if req is not None else 0
            return votes[room]

        agreed = self._agree(self.bootstrap + self.inflight, count=self.mgr.dest_page_count,
                             extra=(vote, lambda room: -vote(room)))
        self._admit_ready(agreed, self.bootstrap, lambda req: self._start_prefill(req, agreed))
        self._settle(agreed, self.inflight, self._transferred)

    def _prefix_vote(self, req: Req) -> int:
        """The pages of D's cached prefix this rank may skip: D's count when its digest is
        this prompt's (the bytes D holds are then the KV of the same token ids), else a
        negative vote that fails the request; first of all, D's whole prompt must be this one
        (a decode request that copied another's route carries another prompt)."""
        prompt = getattr(self.mgr, "dest_prompt", None)  # stand-in managers have none
        theirs = prompt(req.disagg.room) if prompt is not None else None
        if theirs is not None and theirs != req.disagg.prompt_digest:
            return _PROMPT_MISMATCH
        pages, digest = self.mgr.dest_prefix(req.disagg.room)
        if pages <= 0:
            return _RANKS_DISAGREE if pages < 0 else 0
        tokens = pages * self.sched.page_size
        if tokens >= len(req.prompt) or wire.prefix_digest(req.prompt[:tokens]) != digest:
            return _DIGEST_MISMATCH
        return pages

    def _start_prefill(self, req: Req, agreed: Agreed) -> bool:
        """D is known and has sent its pages: prefill once an aux row is free."""
        need = self.sched.pages_for(len(req.prompt))
        have = agreed.counts[req.disagg.room]
        low, neg_high = agreed.extra[req.disagg.room]
        why = ""
        if low == _PROMPT_MISMATCH:
            why = ("the decode server's prompt for this bootstrap room is not this prompt (its "
                   "digest differs): refused before any KV left; a decode request must carry "
                   "the same prompt as its prefill request")
            self.mgr.refuse(req.disagg.room, why, wire.PROMPT_MISMATCH)
            self.bootstrap.remove(req)
            self.sched.fail(req, why, 409, ErrorCode.PROMPT_MISMATCH)
            return True
        if have < need:
            why = f"decode reserved {have} KV pages; the prompt needs {need}"
        elif low == _DIGEST_MISMATCH:
            why = ("PD protocol error: the digest of the prompt prefix decode holds cached does "
                   "not match this prompt's token ids; decode's pages are not reused")
        elif low < 0 or low != -neg_high:
            why = ("PD protocol error: decode's or prefill's TP ranks disagree on the cached "
                   "prompt prefix decode holds")
        if why:
            self.bootstrap.remove(req)
            self.sched.fail(req, why)
            return True
        slot = self.aux.alloc()
        if slot is None:
            return False  # back-pressure: no aux row free; keep FIFO order
        req.disagg.aux_slot = slot
        # D holds the first `low` pages (equal tokens, proven by the digest): send from there
        req.disagg.sent_pages = req.disagg.prefix_pages = low
        self.bootstrap.remove(req)
        self.sched.resume(req)
        return True

    def _transferred(self, req: Req) -> None:
        self.counts["prefix_skipped_pages"] += req.disagg.prefix_pages
        self.counts["transfers"] += not req.disagg.probe
        self._release(req)
        self.sched.complete(req)

    def _fail(self, req: Req, reason: str) -> None:
        # 502: this server is fine, its decode peer failed the pair (the router blames decode)
        status = self._fail_status(req.disagg.room)
        self.sched.fail(req, reason, status, self._fail_code(req.disagg.room, status))

    def after_step(self, results: list[StepResult]) -> None:
        for res in results:
            req = res.req
            if not isinstance(req.disagg, PState) or req.phase is Phase.FINISHED:
                continue
            st = req.disagg
            last = res.token is not None
            done_pages = (len(req.pages) if last
                          else req.num_computed // self.sched.page_size)
            if last:
                lp = req.pending_out_logprobs[-1] if req.pending_out_logprobs else None
                top = (lp[2] or [])[:MAX_TOP_LOGPROBS] if lp else []
                self.aux.write(st.aux_slot, AuxRow(
                    room=st.room, first_token_id=res.token, logprob=lp[0] if lp else 0.0,
                    top_ids=tuple(t for _, t in top), top_logprobs=tuple(v for v, _ in top),
                    prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens))
                self._put_chain_start(req, st.aux_slot)
            if done_pages > st.sent_pages or last:
                pages = np.asarray(req.pages[st.sent_pages:done_pages], dtype=np.int64)
                self.mgr.send(st.room, pages, st.sent_pages, last, st.aux_slot if last else None)
                st.sent_pages = done_pages

    def _put_chain_start(self, req: Req, slot: int) -> None:
        """A draft head's chain start (the first draft token, the head's output vector) goes
        into the aux row: D's first decode step drafts from it. Without one (the head failed
        on this step) D's first step runs without drafts, as it would have anyway."""
        if self.aux.chain is None:
            return
        start = self.sched.chain_start(req)
        if start is None:
            self.counts["chain_starts_missing"] += 1
            return
        try:
            self.aux.write_chain(slot, start[0], len(req.prompt), start[1])
        except (ValueError, RuntimeError) as e:  # costs D its first drafts, nothing else
            log.warning("room %d: chain start not handed over: %s", req.disagg.room, e)
            self.counts["chain_starts_missing"] += 1
            return
        self.counts["chain_starts_sent"] += 1

    def on_finish(self, req: Req) -> bool:
        if not isinstance(req.disagg, PState) or req.error:
            return False
        # the one token is sampled; hold the pages until the transfer finished
        self.sched.hold(req)
        self.inflight.append(req)
        return True

    def on_abort(self, req: Req) -> None:
        if not isinstance(req.disagg, PState):
            return
        for q in (self.bootstrap, self.inflight):
            if req in q:
                q.remove(req)
        self._end_room(req)

    def busy(self) -> bool:
        return bool(self.bootstrap or self.inflight)

    def stats(self) -> StatsReport:
        return self._stats({queue_key("bootstrap"): len(self.bootstrap),
                            queue_key("inflight"): len(self.inflight)})
