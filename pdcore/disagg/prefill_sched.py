"""Prefill-side scheduling: P computes nothing for a request until D has reserved room for it.

1. admit: force max_new_tokens=1, register the room with the KV manager (Bootstrapping) and
   hold the request in the bootstrap queue;
2. when D's destination pages arrived (WaitingForInput) and an aux slot is free, the request
   joins the normal waiting queue and is prefilled in chunks;
3. after every forward pass, the pages a chunk completed are sent at once; the last chunk
   carries the aux row (first token and its logprobs);
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

from pdcore.disagg.agree import poll_all
from pdcore.disagg.aux import MAX_TOP_LOGPROBS, AuxBuffers, AuxRow
from pdcore.disagg.states import TERMINAL, KVPoll
from pdcore.engine.model_runner import StepResult
from pdcore.engine.request import Phase, Req
from pdcore.engine.scheduler import Extension, Scheduler

log = logging.getLogger(__name__)


@dataclass
class PState:
    room: int
    sent_pages: int = 0
    aux_slot: int | None = None


class PrefillExtension(Extension):
    def __init__(self, sched: Scheduler, mgr: Any, aux: AuxBuffers) -> None:
        self.sched, self.mgr, self.aux = sched, mgr, aux
        self.bootstrap: list[Req] = []
        self.inflight: list[Req] = []
        self.counts = {"requests": 0, "transfers": 0}

    def admit(self, req: Req) -> bool:
        if req.bootstrap_room is None:
            self.sched.fail(req, "a prefill server needs bootstrap_room (send requests through "
                                 "the router)", 400)
            return True
        req.params.max_new_tokens = 1
        req.disagg = PState(int(req.bootstrap_room))
        req.phase = Phase.DISAGG
        self.mgr.add(req.disagg.room, req.bootstrap_host)
        self.bootstrap.append(req)
        self.counts["requests"] += 1
        return True

    def poll(self) -> None:
        agreed = poll_all(self.mgr, [r.disagg.room for r in self.bootstrap + self.inflight],
                          self.sched.tp, count=self.mgr.dest_page_count)
        for req in list(self.bootstrap):
            st = agreed.state(req.disagg.room)
            if st is KVPoll.Failed:
                self.bootstrap.remove(req)
                self._fail(req, agreed.reasons.get(req.disagg.room, ""))
                continue
            if st < KVPoll.WaitingForInput:
                continue
            need = self.sched.blocks.pages_for(len(req.prompt))
            have = agreed.counts[req.disagg.room]
            if have < need:
                self.bootstrap.remove(req)
                self.sched.fail(req, f"decode reserved {have} KV pages; the prompt needs {need}")
                continue
            slot = self.aux.alloc()
            if slot is None:
                break  # back-pressure: no aux row free; keep FIFO order
            req.disagg.aux_slot = slot
            self.bootstrap.remove(req)
            self.sched.enqueue(req)
        for req in list(self.inflight):
            st = agreed.state(req.disagg.room)
            if st is KVPoll.Success:
                self.inflight.remove(req)
                self._release(req)
                self.sched.drop(req)
                self.counts["transfers"] += 1
            elif st is KVPoll.Failed:
                self.inflight.remove(req)
                self._fail(req, agreed.reasons.get(req.disagg.room, ""))

    def _fail(self, req: Req, reason: str) -> None:
        # 502: this server is fine, its decode peer failed the pair (the router blames decode)
        self.sched.fail(req, reason, 502 if self.mgr.decode_fault(req.disagg.room) else 500)

    def after_step(self, results: list[StepResult]) -> None:
        for res in results:
            req = res.req
            if not isinstance(req.disagg, PState) or req.phase is Phase.FINISHED:
                continue
            st = req.disagg
            last = res.token is not None
            done_pages = (len(req.pages) if last
                          else req.num_computed // self.sched.blocks.page_size)
            if last:
                lp = req.pending_out_logprobs[-1] if req.pending_out_logprobs else None
                top = (lp[2] or [])[:MAX_TOP_LOGPROBS] if lp else []
                self.aux.write(st.aux_slot, AuxRow(
                    room=st.room, first_token_id=res.token, logprob=lp[0] if lp else 0.0,
                    top_ids=tuple(t for _, t in top), top_logprobs=tuple(v for v, _ in top),
                    prompt_tokens=len(req.prompt)))
            if done_pages > st.sent_pages or last:
                pages = np.asarray(req.pages[st.sent_pages:done_pages], dtype=np.int64)
                self.mgr.send(st.room, pages, st.sent_pages, last, st.aux_slot if last else None)
                st.sent_pages = done_pages

    def on_finish(self, req: Req) -> bool:
        if not isinstance(req.disagg, PState) or req.error:
            return False
        # the one token is sampled; hold the pages until the transfer finished
        if req in self.sched.running:
            self.sched.running.remove(req)
        req.phase = Phase.DISAGG
        self.inflight.append(req)
        return True

    def on_abort(self, req: Req) -> None:
        if not isinstance(req.disagg, PState):
            return
        for q in (self.bootstrap, self.inflight):
            if req in q:
                q.remove(req)
        if self.mgr.poll(req.disagg.room) not in TERMINAL:
            self.mgr.abort(req.disagg.room, req.error or "request aborted")
        self._release(req)

    def _release(self, req: Req) -> None:
        st: PState = req.disagg
        self.mgr.release(st.room)
        if st.aux_slot is not None:
            self.aux.free(st.aux_slot)
            st.aux_slot = None

    def busy(self) -> bool:
        return bool(self.bootstrap or self.inflight)

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {"disagg_bootstrap_queue": len(self.bootstrap),
                **{f"disagg_{k}_total": v for k, v in c.items()},
                "disagg_transfers_per_request": c["transfers"] / max(1, c["requests"]),
                "disagg_inflight_queue": len(self.inflight), "aux_slots_free": self.aux.num_free,
                **{f"kv_{k}": v for k, v in self.mgr.metrics().items()
                   if isinstance(v, (int, float))}}

    def close(self) -> None:
        self.mgr.close()
