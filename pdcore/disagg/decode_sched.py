"""Decode-side scheduling: reserve room, receive the KV, then decode as usual.

1. admit: register the room with the KV manager (Bootstrapping: P is looked up) and hold the
   request in the prealloc queue;
2. FIFO, when P is known (WaitingForInput), a request slot, the prompt's pages plus a decode
   reserve, and an aux slot are free: allocate them and send P the destination pages
   (Transferring);
3. on Success: check the aux row carries this room, take the first token (and its logprobs)
   from it, free the aux slot, and put the request into the running batch with the prompt's
   K/V already in place; the first token goes to the client at once (Scheduler.step sends the
   tokens poll() produced before it runs a forward pass);
4. on Failed (P died, timeout, abort): free pages and aux slot; the client gets the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcore.config import ServerArgs
from pdcore.disagg.agree import poll_all
from pdcore.disagg.aux import AuxBuffers
from pdcore.disagg.states import TERMINAL, KVPoll
from pdcore.engine.request import Phase, Req
from pdcore.engine.scheduler import Extension, Scheduler

log = logging.getLogger(__name__)

# Pages of a request aborted while P may still be writing into them are held this long
# before reuse, so a late write can never land in another request's KV.
QUARANTINE_S = 5.0


@dataclass
class DState:
    room: int
    aux_slot: int | None = None


class DecodeExtension(Extension):
    def __init__(self, sched: Scheduler, mgr: Any, aux: AuxBuffers, args: ServerArgs) -> None:
        self.sched, self.mgr, self.aux, self.args = sched, mgr, aux, args
        self.prealloc: list[Req] = []
        self.transfer: list[Req] = []
        self.quarantine: list[tuple[float, list[int]]] = []

    def admit(self, req: Req) -> bool:
        if req.bootstrap_room is None or not req.bootstrap_host:
            self.sched.fail(req, "a decode server needs bootstrap_host and bootstrap_room "
                                 "(send requests through the router)", 400)
            return True
        req.logprob_start_len = -1  # prompt logprobs come from P (the router merges them)
        port = req.bootstrap_port or self.args.disaggregation_bootstrap_port
        req.disagg = DState(int(req.bootstrap_room))
        req.phase = Phase.DISAGG
        self.mgr.add(req.disagg.room, req.bootstrap_host, int(port))
        self.prealloc.append(req)
        return True

    def _reserve_pages(self, req: Req) -> int:
        extra = min(req.params.max_new_tokens, self.args.num_reserved_decode_tokens)
        return self.sched.blocks.pages_for(len(req.prompt) + extra)

    def poll(self) -> None:
        blocks = self.sched.blocks
        now = self.sched.now()  # the same on every TP rank
        while self.quarantine and self.quarantine[0][0] <= now:
            blocks.free(self.quarantine.pop(0)[1])
        agreed = poll_all(self.mgr, [r.disagg.room for r in self.prealloc + self.transfer],
                          self.sched.tp)
        for req in list(self.prealloc):
            st = agreed.state(req.disagg.room)
            if st is KVPoll.Failed:
                self.prealloc.remove(req)
                self.sched.fail(req, agreed.reasons.get(req.disagg.room, ""))
                continue
            if st < KVPoll.WaitingForInput:
                continue
            busy = len(self.sched.running) + len(self.transfer) + len(self.sched.waiting)
            if busy >= self.sched.cfg.max_running or not blocks.can_alloc(self._reserve_pages(req)):
                break  # FIFO: the head waits for room, the rest wait behind it
            slot = self.aux.alloc()
            if slot is None:
                break
            req.pages = blocks.alloc(blocks.pages_for(len(req.prompt)))
            req.disagg.aux_slot = slot
            self.prealloc.remove(req)
            self.transfer.append(req)
            self.mgr.send_transfer_info(req.disagg.room, np.asarray(req.pages, np.int64), slot)
        for req in list(self.transfer):
            st = agreed.state(req.disagg.room)
            if st is KVPoll.Success:
                self.transfer.remove(req)
                self._start_decoding(req)
            elif st is KVPoll.Failed:
                self.transfer.remove(req)
                self.sched.fail(req, agreed.reasons.get(req.disagg.room, ""))

    def _start_decoding(self, req: Req) -> None:
        st: DState = req.disagg
        row = self.aux.read(st.aux_slot)
        if row.room != st.room:
            self.sched.fail(req, f"aux row of room {st.room} holds room {row.room} (corrupt or "
                                 f"not written)")
            return
        self._release(req)
        req.disagg = None
        req.num_computed = len(req.prompt)
        req.phase = Phase.RUNNING
        self.sched.running.append(req)
        lp = None
        if req.return_logprob:
            top = list(zip(row.top_logprobs, row.top_ids))[: req.top_logprobs_num] or None
            lp = (row.logprob, row.first_token_id, top if req.top_logprobs_num else None)
        req.state.observe(row.first_token_id)
        self.sched.push_token(req, row.first_token_id, lp)

    def on_abort(self, req: Req) -> None:
        if not isinstance(req.disagg, DState):
            return
        if req in self.prealloc:
            self.prealloc.remove(req)
        if req in self.transfer:
            self.transfer.remove(req)
            if req.pages:  # P may still be writing into them
                self.quarantine.append((self.sched.now() + QUARANTINE_S, req.pages))
                req.pages = []
        if self.mgr.poll(req.disagg.room) not in TERMINAL:
            self.mgr.abort(req.disagg.room, req.error or "request aborted")
        self._release(req)

    def _release(self, req: Req) -> None:
        st: DState = req.disagg
        self.mgr.release(st.room)
        if st.aux_slot is not None:
            self.aux.free(st.aux_slot)
            st.aux_slot = None

    def busy(self) -> bool:
        return bool(self.prealloc or self.transfer or self.quarantine)

    def stats(self) -> dict[str, Any]:
        return {"disagg_prealloc_queue": len(self.prealloc),
                "disagg_transfer_queue": len(self.transfer),
                "disagg_quarantined_pages": sum(len(p) for _, p in self.quarantine),
                "aux_slots_free": self.aux.num_free,
                **{f"kv_{k}": v for k, v in self.mgr.metrics().items()
                   if isinstance(v, (int, float))}}

    def close(self) -> None:
        self.mgr.close()
