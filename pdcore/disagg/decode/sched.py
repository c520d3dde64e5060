"""Decode-side scheduling: reserve room, receive the KV, then decode as usual.

1. admit: register the room with the KV manager (Bootstrapping: P is looked up) and hold the
   request in the prealloc queue;
2. FIFO, when P is known (WaitingForInput), a request slot, the prompt's pages plus a decode
   reserve, and an aux slot are free: allocate them and send P the destination pages
   (Transferring);
3. on Success: check the aux row carries this room, take the first token (and its logprobs)
   from it, free the aux slot, and put the request into the running batch with the prompt's
   K/V already in place; the first token goes to the client at once (the engine step,
   engine/loop.py, sends the tokens poll() produced before it runs a forward pass); with a draft head, the row's chain
   start (checked: vocabulary, position, finite values) makes its first decode step draft;
4. on Failed (P died, timeout, abort): free pages and aux slot; the client gets the reason.

Parallel samples (n > 1): the HTTP layer sends sample 0 of a prompt with the room and, in the
same message (GenerateReq.forks), samples 1..n-1 with `fork_of` = sample 0's rid, so they always
enter before sample 0's KV can arrive (sent one by one, a sibling could come after it: s8c's
race). Only sample 0 runs the protocol; the others wait parked
on it (their pages are part of its reservation) and, when its KV arrives, fork from its prompt
pages (pdcore.engine.sched.fork) before sample 0's first token is pushed (that token may finish it and
free its pages). Sample 0 keeps P's first token; each other sample recomputes the last prompt
position and samples its own. If sample 0 fails or is aborted before its KV arrived, its parked
samples fail with it; afterwards every sample lives on its own (pages freed by reference count).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdcore.config import ServerArgs
from pdcore.disagg import wire
from pdcore.disagg.aux import AuxBuffers, ChainRow
from pdcore.disagg.common import FAKE_BOOTSTRAP_HOST
from pdcore.disagg.role import RoleExtension
from pdcore.engine.sched.request import Req
from pdcore.engine.sched.scheduler import Scheduler
from pdcore.engine.sched.stats import StatsReport
from pdcore.messages.stats import queue_key

log = logging.getLogger(__name__)

# Pages of a request aborted while P may still be writing into them are held this long
# before reuse, so a late write can never land in another request's KV.
QUARANTINE_S = 5.0


@dataclass
class DState:
    room: int
    aux_slot: int | None = None
    followers: list[Req] = field(default_factory=list)  # parallel samples parked on this one
    prefix_pages: int = 0  # leading pages taken from this server's prefix cache (not sent)
    probe: bool = False  # /health_generate's fake room: not counted as a PD request


@dataclass
class Parked:
    """A parallel sample waiting for its leader's KV."""

    leader: Req


class DecodeExtension(RoleExtension):
    def __init__(self, sched: Scheduler, mgr: Any, aux: AuxBuffers, args: ServerArgs) -> None:
        super().__init__(sched, mgr, aux, ["requests", "samples", "transfers", "forks",
                                           "fork_recomputes", "prefix_reused_tokens",
                                           "prefix_reused_bytes", "chain_starts_received",
                                           "chain_starts_dropped"])
        self.args = args
        self.prealloc: list[Req] = []
        self.transfer: list[Req] = []
        self.quarantine: list[tuple[float, list[int]]] = []

    def admit(self, req: Req) -> bool:
        route = req.route
        if route is not None and route.fork_of is not None:
            return self._park(req, route.fork_of)
        if route is None or route.room is None or not route.host:
            self.sched.fail(req, "a decode server needs bootstrap_host and bootstrap_room "
                                 "(send requests through the router)", 400)
            return True
        if self._duplicate(req, int(route.room)):
            return True
        req.logprob_start_len = -1  # prompt logprobs come from P (the router merges them)
        port = route.port or self.args.disaggregation_bootstrap_port
        probe = route.host == FAKE_BOOTSTRAP_HOST
        self._take(req, DState(int(route.room), probe=probe))
        self.mgr.add(req.disagg.room, route.host, int(port), route.prefill_dp_rank)
        self.prealloc.append(req)
        self.counts["requests"] += not probe
        self.counts["samples"] += not probe
        return True

    def _park(self, req: Req, fork_of: str) -> bool:
        leader = self.sched.find(fork_of)
        st = leader.disagg if leader is not None else None
        if not isinstance(st, DState) or leader.prompt != req.prompt:
            self.sched.fail(req, f"parallel sample {req.rid} forks from sample {fork_of!r}, "
                                 "which is not waiting for its KV on this decode server "
                                 "(it finished, failed or was never sent here)")
            return True
        req.logprob_start_len = -1
        self._take(req, Parked(leader))
        st.followers.append(req)
        self.counts["samples"] += 1
        return True

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page in this rank's pool (K and V of every layer, or MLA's one
        latent buffer per layer)."""
        return self.mgr.kv.page_bytes

    def _extra(self, req: Req) -> int:
        return min(req.params.max_new_tokens, self.args.num_reserved_decode_tokens)

    def _reserve_pages(self, req: Req) -> int:
        """Pages the request and its parked samples need (capped at the pool: a group larger
        than the pool still starts once everything else has left; preemption does the rest)."""
        need = self.sched.pages_for(len(req.prompt) + self._extra(req))
        for f in req.disagg.followers:
            need += self.sched.follower_pages(len(f.prompt), self._extra(f))
        return min(need, self.sched.num_pages)

    def poll(self) -> None:
        sched = self.sched
        now = sched.now()  # the same on every TP rank
        while self.quarantine and self.quarantine[0][0] <= now:
            sched.free_pages(self.quarantine.pop(0)[1])
        agreed = self._agree(self.prealloc + self.transfer)
        self._admit_ready(agreed, self.prealloc, self._reserve)
        self._settle(agreed, self.transfer, self._start_decoding)

    def _reserve(self, req: Req) -> bool:
        """P is known: take a request slot, the pages and an aux row, and send P the pages;
        False while they are not free (FIFO: the head waits for room, the rest behind it).
        With a prefix cache, the prompt's longest cached prefix (whole pages, never the last
        position) is locked first and only the rest is allocated; P sends only the rest."""
        sched = self.sched
        busy = sched.occupancy() + sum(1 + len(r.disagg.followers) for r in self.transfer)
        group = 1 + len(req.disagg.followers)
        if busy and busy + group > sched.max_running:
            return False
        cached = sched.attach_prefix(req, len(req.prompt) - 1) if sched.has_cache else 0
        held = len(req.pages)
        slot = None
        if sched.can_alloc(max(0, self._reserve_pages(req) - held)):
            slot = self.aux.alloc()
        if slot is None:  # wait holding nothing: the prefix is matched again next time
            sched.drop_pages(req)
            return False
        sched.extend_pages(req, len(req.prompt))
        st: DState = req.disagg
        st.aux_slot, st.prefix_pages = slot, held
        self.prealloc.remove(req)
        self.transfer.append(req)
        prefix = ({"prefix_pages": held, "prefix_digest": wire.prefix_digest(req.prompt[:cached])}
                  if held else {})
        self.mgr.send_transfer_info(st.room, np.asarray(req.pages, np.int64), slot,
                                    prompt_digest=wire.prefix_digest(req.prompt), **prefix)
        return True

    def _start_decoding(self, req: Req) -> None:
        st: DState = req.disagg
        row = self.aux.read(st.aux_slot)
        if row.room != st.room:
            self.sched.fail(req, f"aux row of room {st.room} holds room {row.room} (corrupt or "
                                 f"not written)")
            return
        followers = st.followers
        chain = self._chain_start(req, st)  # before the slot is freed (and cleared)
        self._release(req)
        req.disagg = None
        self.sched.run(req, computed=len(req.prompt))
        self.counts["transfers"] += not st.probe
        if st.prefix_pages:  # these pages did not cross: D's cache had the same tokens' KV
            self.counts["prefix_reused_tokens"] += st.prefix_pages * self.sched.page_size
            self.counts["prefix_reused_bytes"] += st.prefix_pages * self.page_bytes
        for f in followers:  # before the first token: it may finish the leader (pages freed)
            self._fork(req, f)
        lp = None
        if req.return_logprob:
            top = list(zip(row.top_logprobs, row.top_ids))[: req.top_logprobs_num] or None
            lp = (row.logprob, row.first_token_id, top if req.top_logprobs_num else None)
        req.cached_tokens = row.cached_tokens  # P's prefix-cache hit: what it did not compute
        if chain is not None and self.sched.adopt_chain_start(req, chain.token, chain.hidden):
            self.counts["chain_starts_received"] += 1
        req.state.observe(row.first_token_id)
        self.sched.push_token(req, row.first_token_id, lp)

    def _chain_start(self, req: Req, st: DState) -> ChainRow | None:
        """With a draft head, P's chain start in the aux row, which makes the request's first
        decode step draft. Read as hostile: one that fails a check is dropped (logged,
        counted); the verify keeps the output exact whatever the drafts are."""
        if self.aux.chain is None:
            return None
        start, why = self.aux.read_chain(st.aux_slot, len(req.prompt))
        if why:
            log.warning("room %d: chain start from prefill dropped: %s", st.room, why)
            self.counts["chain_starts_dropped"] += 1
        return start

    def _fork(self, leader: Req, f: Req) -> None:
        f.disagg = None
        self.counts["forks"] += 1
        if self.sched.fork(leader, f):
            self.sched.run(f, computed=f.num_computed)
        else:  # no page for the copy: recompute the prompt's tail when the scheduler finds one
            self.counts["fork_recomputes"] += 1
            self.sched.resume(f, front=True)

    def _fail(self, req: Req, reason: str) -> None:
        # 502: this server is fine, its prefill peer failed the pair (the router blames prefill,
        # unless the code says that prefill instance restarted: the one there now is new)
        status = self._fail_status(req.disagg.room)
        self.sched.fail(req, reason, status, self._fail_code(req.disagg.room, status))

    def on_abort(self, req: Req) -> None:
        if isinstance(req.disagg, Parked):  # it holds no pages yet: just leave the leader
            st = req.disagg.leader.disagg
            if isinstance(st, DState) and req in st.followers:
                st.followers.remove(req)
            req.disagg = None
            return
        if not isinstance(req.disagg, DState):
            return
        followers, req.disagg.followers = req.disagg.followers, []
        for f in followers:
            f.disagg = None
            self.sched.fail(f, f"sample 0 of this prompt ({req.rid}) ended before its KV "
                               f"arrived: {req.error or 'aborted'}", req.error_status)
        if req in self.prealloc:
            self.prealloc.remove(req)
        if req in self.transfer:
            self.transfer.remove(req)
            pages = self.sched.take_pages(req)
            if pages:  # P may still be writing into them, except D's cached prefix
                k = req.disagg.prefix_pages  # P never writes those (its send() refuses to)
                self.sched.free_pages(pages[:k])
                self.quarantine.append((self.sched.now() + QUARANTINE_S, pages[k:]))
        self._end_room(req)

    def busy(self) -> bool:
        return bool(self.prealloc or self.transfer or self.quarantine)

    def stats(self) -> StatsReport:
        return self._stats({
            queue_key("prealloc"): len(self.prealloc),
            queue_key("transfer"): len(self.transfer),
            "disagg_parked_samples": sum(len(r.disagg.followers)
                                         for r in self.prealloc + self.transfer),
            "disagg_quarantined_pages": sum(len(p) for _, p in self.quarantine)})
