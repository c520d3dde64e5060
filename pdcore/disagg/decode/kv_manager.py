"""Decode-side KV manager (the receiver): what D's scheduler drives, whatever the backend.

Lifecycle:
1. `__init__`: create the transfer backend, register KV regions and the aux region in one call;
2. `start()`: bind the control plane, start the heartbeat toward known prefill instances;
3. per request: `add(room, host, port)` -> Bootstrapping; a resolver thread fetches P's instance
   info from its bootstrap server (cached per address; page size / dtype / backend checked),
   the rank addresses D needs (rank mapping by TP sizes), and registers with each of those P
   ranks once per P instance (`prefills`: decode/resolve.py); the room is claimed (Claim to its
   P ranks) and, once P confirmed it has the request (Claimed), -> WaitingForInput (waiting
   timeout running) (`binding`: decode/peers.py, which also applies the heartbeat's verdicts);
4. the scheduler pre-allocates pages and an aux slot, `send_transfer_info()` -> Transferring;
5. P writes the pages and the aux row, then Status(Success) from every required P rank; the aux
   row must carry the room -> Success; Status(Failed), the waiting timeout (Abort sent to P),
   the heartbeat losing P, or `abort()` -> Failed;
6. `release(room)` forgets the room; `close()` stops heartbeat, resolver, control plane, backend.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pdcore.disagg import wire
from pdcore.disagg.aux import AuxRow
from pdcore.disagg.common import FAKE_BOOTSTRAP_HOST, advertised_host
from pdcore.disagg.decode.peers import CONFIRM_FACTOR, PrefillBinding
from pdcore.disagg.decode.resolve import Pairing, PrefillDirectory
from pdcore.disagg.decode.rooms import Instance, Room
from pdcore.disagg.heartbeat import Heartbeat
from pdcore.disagg.manager import KVManager
from pdcore.disagg.staging import GrantBook, scatter_grant
from pdcore.disagg.states import TERMINAL, KVPoll
from pdcore.interfaces.transfer import MemoryRegion

log = logging.getLogger("pdcore.disagg.decode")


class DecodeKVManager(KVManager):
    """The receiver: D's rooms, the prefill instances they resolve to (`prefills`), which
    instance each room pulls from (`binding`), the heartbeat."""

    role = "decode"
    peer_fault_codes = frozenset({wire.PREFILL_FAULT, wire.PREFILL_RESTARTED})

    def _adopt_staging(self, staging: Any) -> list[MemoryRegion]:
        self.grants = GrantBook(staging) if staging is not None else None
        self._scatters = (ThreadPoolExecutor(2, thread_name_prefix=f"pd-d{self.tp_rank}-scatter")
                          if staging is not None else None)
        return [staging.region] if staging is not None else []

    def _setup(self) -> None:
        args, env, tp_rank = self.args, self.env, self.tp_rank
        self.session = (f"{advertised_host(args.host)}/{args.server_id}/{tp_rank}/"
                        f"{uuid.uuid4().hex[:8]}")
        self.decode_id = args.server_id  # every rank of this server: P binds a room to it
        self._rooms: dict[int, Room] = {}
        me = Pairing(self.session, tp_rank, self.tp_size, self.backend_name, self.kv,
                     self.fingerprint, self.aux.chain_info(), self.token)
        self.prefills = PrefillDirectory(self._lock, self.ctrl, self.counters, env, me)
        self.binding = PrefillBinding(
            lock=self._lock, rooms=self._rooms, states=self.states, prefills=self.prefills,
            ctrl=self.ctrl, counters=self.counters, env=env, me=me, decode_id=self.decode_id,
            fail=self._fail, send_info=self._send_info, staged=self._staged,
            down_since=lambda addr: self.heartbeat.down_since(addr))
        self._handlers = {wire.Status: self._on_status, wire.AbortAck: self._on_abort_ack,
                          wire.HelloAck: self.prefills.on_hello_ack,
                          wire.Claimed: self.binding.on_claimed}
        self.heartbeat = Heartbeat(env.heartbeat_interval, env.heartbeat_max_failure,
                                   self.prefills.known, self.binding.lose, self.token,
                                   on_restart=self.binding.restarted)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        addr = self.ctrl.start()
        self.prefills.register = wire.Register(
            session=self.session, ctrl_addr=addr, backend=self.backend_name,
            endpoint=self.backend.endpoint(), layout=self.kv.to_dict(),
            regions=[r.to_dict() for r in self.kv_regions], aux_region=self.aux.region.to_dict(),
            aux_row_bytes=self.aux.row_bytes, aux_slots=self.aux.num_slots, rank=self.tp_rank,
            tp_size=self.tp_size, page_size=self.kv.page_size, dtype=str(self.kv.dtype),
            staging_region=self.grants.staging.region.to_dict() if self.grants else None,
            model_fingerprint=self.fingerprint, **self.aux.chain_info())
        self.heartbeat.start()
        log.info("decode KV manager rank %d/%d: control %s, session %s, backend %s",
                 self.tp_rank, self.tp_size, addr, self.session, self.backend_name)

    def _shutdown(self) -> None:
        self.heartbeat.close()
        self.binding.close()
        self.ctrl.close()
        self.backend.close()
        if self._scatters is not None:
            self._scatters.shutdown(wait=True, cancel_futures=True)
        if self.grants is not None:
            self.grants.staging.close()

    # -- scheduler API ---------------------------------------------------------------------
    def add(self, room: int, bootstrap_host: str, bootstrap_port: int,
            prefill_dp_rank: int | None = None) -> None:
        host = f"[{bootstrap_host}]" if ":" in bootstrap_host else bootstrap_host
        addr = f"{host}:{int(bootstrap_port)}"
        now = time.monotonic()
        with self._lock:
            if not self._claim(room):
                return
            r = Room(room, addr, now, fake=bootstrap_host == FAKE_BOOTSTRAP_HOST,
                     prefill_dp=prefill_dp_rank)
            self._rooms[room] = r
            if r.fake:
                self.states.create(room, KVPoll.WaitingForInput)
                return
            self.states.create(room, KVPoll.Bootstrapping)
            inst = self.prefills.get(addr)
            if inst is not None:  # the common case: P already known, no thread hop
                self.binding.attach(r, inst)
                return
        self.binding.resolve_later(room, addr, now)

    def send_transfer_info(self, room: int, dst_pages: np.ndarray, aux_slot: int,
                           prefix_pages: int = 0, prefix_digest: str = "",
                           prompt_digest: str = "") -> None:
        """Tell P where the room's KV goes: all of the prompt's pages, of which the first
        `prefix_pages` hold D's cached prefix already (tokens digested in `prefix_digest`);
        `prompt_digest` digests the whole prompt (P refuses to prefill for another one)."""
        pages = np.asarray(dst_pages, dtype=np.int64).ravel()
        # a protocol violation by our scheduler fails the room (P is told), not the engine
        why = f"aux slot {aux_slot} out of range" if not 0 <= aux_slot < self.aux.num_slots else (
            "page indices outside this pool" if len(pages) and (
                pages.min() < 0 or pages.max() >= self.kv.num_pages) else "")
        if not why and not 0 <= prefix_pages < max(len(pages), 1):
            why = f"prefix of {prefix_pages} pages leaves none of the {len(pages)} to transfer"
        with self._lock:
            r = self._rooms.get(room)
            state = self.states.get(room)
            if r is None or state is KVPoll.Failed:  # released or failed: poll() says Failed
                return
            if r.fake and not why:  # no prefill involved: a placeholder row, then Success
                self.aux.write(aux_slot, AuxRow(room=room, first_token_id=0))
                r.aux_slot = aux_slot
                self.states.advance(room, KVPoll.Success)
                return
            if not why and (state is not KVPoll.WaitingForInput or r.inst is None):
                why = (f"send_transfer_info() in state {state.name if state else None}; wait "
                       "for WaitingForInput")
            if why:
                self._fail(room, why)
                return
            self.aux.clear(aux_slot)  # a stale row in a reused slot must never pass the check
            r.aux_slot, r.dst_pages = aux_slot, pages
            r.prefix_pages, r.prefix_digest = prefix_pages, prefix_digest
            r.prompt_digest = prompt_digest
            r.deadline = time.monotonic() + self.env.waiting_timeout
            self.states.advance(room, KVPoll.Transferring)
            nbytes = (self.grants.staging.grant_bytes(len(pages) - prefix_pages, r.inst.tp_size)
                      if self._staged(r.inst) else 0)
            why = self.grants.too_big(nbytes) if nbytes else ""
            offset = self.grants.reserve(room, nbytes) if nbytes and not why else None
            if offset is not None:
                r.grant = (offset, nbytes)
            deferred = r.rebinding  # _rebind sends it to the new instance
        if why:
            self._fail(room, why)
        elif (not nbytes or offset is not None) and not deferred:  # else: _on_tick or _rebind
            self._send_info(r)

    def _staged(self, inst: Instance) -> bool:
        """KV from `inst` goes through D's staging ring (a grant per room): P runs another TP."""
        return self.grants is not None and inst.tp_size != self.tp_size

    def _send_info(self, r: Room) -> None:
        inst, pages = r.inst, r.dst_pages
        assert inst is not None and pages is not None
        off, nbytes = r.grant or (-1, 0)
        msg = wire.TransferInfo(room=r.room, session=self.session, ctrl_addr=self.ctrl.addr,
                                rank=self.tp_rank, dst_pages=wire.encode_pages(pages),
                                aux_slot=r.aux_slot, required=inst.required_dst,
                                staging_offset=off, staging_len=nbytes,
                                prefix_pages=r.prefix_pages, prefix_digest=r.prefix_digest,
                                decode_id=self.decode_id, prompt_digest=r.prompt_digest)
        dp = r.prefill_dp_of(inst)
        r.sent_at = time.monotonic()  # before sending: a restart seen later may blame it
        for a in [inst.ctrl_addrs[(dp, t)] for t in inst.targets]:
            if not self.ctrl.send(a, msg):
                self._fail(r.room, f"cannot reach prefill rank at {a}", code=wire.PREFILL_FAULT,
                           notify=False)
                return
        log.debug("room %d: transfer info sent (%d pages, %d cached, aux slot %d, staging %d B)",
                  r.room, len(pages), r.prefix_pages, r.aux_slot, nbytes)

    def abort(self, room: int, reason: str) -> None:
        self._fail(room, f"aborted: {reason}")

    def release(self, room: int) -> None:
        with self._lock:
            r = self._rooms.get(room)
            grant = None
            if r is not None:
                grant, r.grant = r.grant, None
            super().release(room)
        if r is not None and self.grants is not None:
            self.grants.cancel(room)
            if grant is not None:  # not scattered: P may still write into it
                self.grants.free(grant[0], quarantine=True)

    def _role_metrics(self) -> dict:
        with self._lock:
            out = {"prefill_instances": len(self.prefills)}
        out["heartbeat_checks"] = self.heartbeat.checks
        return out | (self.grants.stats() if self.grants is not None else {})

    # -- control plane (receive thread) ------------------------------------------------------
    def _on_abort_ack(self, msg: wire.AbortAck) -> None:
        self.counters.add("abort_acks")
        log.debug("room %d: abort acknowledged by prefill rank %d", msg.room, msg.rank)

    def _on_status(self, msg: wire.Status) -> None:
        done = False
        with self._lock:
            r = self._rooms.get(msg.room)
            if r is None or r.fake or self.states.get(msg.room) in TERMINAL:
                self.counters.add("stale_messages")
                return
            inst = r.inst
            if msg.state == KVPoll.Success:
                if inst is None or r.aux_slot < 0 or msg.rank not in inst.targets:
                    log.warning("room %d: unexpected Success from prefill rank %d ignored",
                                msg.room, msg.rank)
                    return
                r.responders.add(msg.rank)
                if msg.staged:
                    r.staged_by.add(msg.rank)
                r.aux_payload = msg.aux or r.aux_payload
                done = len(r.responders) >= inst.responses
        if msg.state == KVPoll.Failed:
            code = (msg.code if msg.code in wire.CLIENT_FAULTS else
                    "" if msg.code in wire.DECODE_FAULTS else wire.PREFILL_FAULT)
            self._fail(msg.room, f"prefill rank {msg.rank} failed: {msg.reason}", code=code,
                       notify=False)
            if msg.code in (wire.UNKNOWN_SESSION, wire.SESSION_FAILED) and inst is not None:
                # P dropped us: the next room resolves and registers
                self.prefills.forget(r.addr, inst)
        elif done:
            self._complete(r)

    def _complete(self, r: Room) -> None:
        if r.staged_by and self._scatters is not None:  # off the control thread: it is a copy
            self._scatters.submit(self._finish_room, r)
        else:
            self._finish_room(r)

    def _finish_room(self, r: Room) -> None:
        if r.aux_payload:
            self.aux.write_raw(r.aux_slot, r.aux_payload)
        why = self._scatter(r)
        if why:
            self._fail(r.room, why)
            return
        row = self.aux.read(r.aux_slot)
        if row.room != r.room:
            self._fail(r.room, f"aux row in slot {r.aux_slot} carries room {row.room}, expected "
                               f"{r.room} (not written or corrupted)")
            return
        if r.dst_pages is not None:  # what P wrote into this rank: its pages past the prefix
            self.xfer.add_bytes(r.room, (len(r.dst_pages) - r.prefix_pages) * self.kv.page_bytes
                                + self.aux.chain_bytes)  # and a draft head's chain start
        if self.states.advance(r.room, KVPoll.Success):
            self.counters.add("transfers")
            log.debug("room %d: KV received", r.room)

    def _scatter(self, r: Room) -> str:
        """Move a staged room's grant into its pages; '' or why it failed."""
        with self._lock:  # claim the grant: release() may race with us
            grant, r.grant = r.grant, None
        pages = (r.dst_pages[r.prefix_pages:]  # the grant's pages
                 if r.dst_pages is not None else None)
        why = scatter_grant(self.grants, r.room, grant, r.staged_by, r.responders, pages,
                            prefill_tp=r.inst.tp_size if r.inst else 0)
        if grant is not None and r.staged_by and not why:
            self.counters.add("staged_rooms")
        return why

    def _on_tick(self) -> None:
        now = time.monotonic()
        for room, offset, nbytes in self.grants.ready(now) if self.grants is not None else []:
            with self._lock:
                r = self._rooms.get(room)
                ok = r is not None and self.states.get(room) is KVPoll.Transferring
                if ok:
                    r.grant = (offset, nbytes)
                    send = not r.rebinding  # else _rebind sends it, grant and all
            if ok and send:
                self._send_info(r)
            else:
                self.grants.free(offset, quarantine=False)
        why = f"waiting timeout: no KV from prefill within {self.env.waiting_timeout:g}s"
        unconfirmed = (f"claim timeout: prefill did not confirm this room within "
                       f"{CONFIRM_FACTOR * self.env.claim_timeout:g}s: it never received the "
                       "request (a decode request must go with its prefill request)")
        for room, reason in self._expired(now, {KVPoll.Bootstrapping: unconfirmed,
                                                KVPoll.WaitingForInput: why,
                                                KVPoll.Transferring: why}):
            if reason is unconfirmed:  # P lost or never got the request: P's fault (502)
                self.counters.add("unconfirmed_rooms")
                self._fail(room, reason, code=wire.PREFILL_FAULT)
            else:
                self._fail(room, reason)

    # -- failures ------------------------------------------------------------------------------
    def _notify_failed(self, r: Room, reason: str, code: str) -> None:
        if r.inst is not None and not r.rebinding:  # a rebinding room's inst is gone
            self.binding.send_abort(r, r.inst, reason)
