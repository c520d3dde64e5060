"""Prefill-side KV manager (the sender): what P's scheduler drives, whatever the backend.

Lifecycle:
1. `__init__`: create the transfer backend, register KV regions and the aux region in one call,
   pick the planner;
2. `start()`: bind the control plane; rank 0 starts the bootstrap server; every rank registers
   its control address there (`PUT /route`); start the sharded transfer workers;
3. D registers (Register: validated, kept as a session); per request the scheduler `add(room)`s
   (Bootstrapping, bootstrap timeout running); D's TransferInfo(s) arrive (pages validated) ->
   WaitingForInput; the scheduler prefills and `send()`s each finished chunk -> Transferring; a
   worker plans, bounds-checks and writes it; after the last chunk the aux row follows and
   Status(Success) goes to every D rank of the room -> Success;
4. any failure (bad message, backend error, timeout, abort from either side, a send() out of
   turn, a duplicate room) -> Failed, with a Status(Failed) to D; a backend error also drops
   the D session at once (Status code SESSION_FAILED), and D registers again on its next room;
5. `release(room)` forgets the room; `close()` stops workers, control plane, server, backend.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.disagg import wire
from pdcore.disagg.aux import AuxBuffers
from pdcore.disagg.bootstrap import BootstrapClient, BootstrapServer
from pdcore.disagg.common import FAKE_BOOTSTRAP_HOST, advertised_host
from pdcore.disagg.manager import KVManager
from pdcore.disagg.prefill.chunks import ChunkRoute, ChunkWriter
from pdcore.disagg.prefill.claims import MAX_PENDING, MAX_PENDING_PER_PEER, RoomClaims
from pdcore.disagg.prefill.rooms import (
    Chunk,
    DestViews,
    PendingTable,
    RoomState,
    send_violation,
)
from pdcore.disagg.prefill.sessions import SessionTable
from pdcore.disagg.sessions import parse_register
from pdcore.disagg.states import KVPoll
from pdcore.disagg.workers import ShardedWorkers
from pdcore.errors import ProtocolError
from pdcore.interfaces.planner import KVLayout
from pdcore.messages.bootstrap import BootstrapInfo, RankRoute
from pdcore.interfaces.transfer import MemoryRegion
from pdcore.route_auth import announce_local_prefill, withdraw_local_prefill

log = logging.getLogger("pdcore.disagg.prefill")


class PrefillKVManager(KVManager):
    """The sender: P's rooms, D sessions, the bootstrap server (rank 0), transfer workers. Its
    parts (composed, sharing its lock and tables): `claims` (which decode server a room
    belongs to, prefill/claims.py), `chunks` (the transfer workers' writes, prefill/chunks.py)
    and `dests` (what the scheduler reads of a room's destinations, prefill/rooms.py)."""

    role = "prefill"
    peer_fault_codes = wire.DECODE_FAULTS

    def __init__(self, args: ServerArgs, env: DisaggEnv, kv: KVLayout,
                 kv_regions: list[MemoryRegion], aux: AuxBuffers, backend_name: str,
                 *, tp_rank: int = 0, tp_size: int = 1, kv_tensors: Sequence[Any] | None = None,
                 pool: Any = None, route_secret: str = "") -> None:
        # proves to the bootstrap server that a PUT /route comes from this instance's ranks
        self.route_secret = route_secret or secrets.token_hex(16)
        super().__init__(args, env, kv, kv_regions, aux, backend_name,
                         tp_rank=tp_rank, tp_size=tp_size, kv_tensors=kv_tensors, pool=pool)

    def _adopt_staging(self, staging: Any) -> list[MemoryRegion]:
        self.staging: Any = staging
        return list(staging.regions) if staging is not None else []

    def _setup(self) -> None:
        args, env, tp_rank = self.args, self.env, self.tp_rank
        self._rooms: dict[int, RoomState] = {}
        self._pending = PendingTable(MAX_PENDING, MAX_PENDING_PER_PEER)
        self._tombstones: dict[int, tuple[str, float]] = {}  # released failed rooms
        self.sessions = SessionTable(self.backend, self._lock)
        self.claims = RoomClaims(
            lock=self._lock, rooms=self._rooms, pending=self._pending,
            tombstones=self._tombstones, sessions=self.sessions, states=self.states,
            counters=self.counters, ctrl=self.ctrl, tp_rank=tp_rank, fail=self._fail,
            ready=self._maybe_ready)
        self.chunks = ChunkWriter(
            lock=self._lock, rooms=self._rooms, states=self.states, sessions=self.sessions,
            route=ChunkRoute(self.backend, self.planner, self.staging, self.kv, self.aux),
            counters=self.counters, xfer=self.xfer, env=env, ctrl=self.ctrl, tp_rank=tp_rank,
            fail=self._fail)
        self.dests = DestViews(self._lock, self._rooms)
        self._handlers = {wire.TransferInfo: self.claims.on_transfer_info,
                          wire.Register: self._on_register, wire.Abort: self._on_abort,
                          wire.Hello: self._on_hello, wire.Claim: self.claims.on_claim}
        self.workers = ShardedWorkers(env.queue_size, env.thread_pool_size,
                                      self.chunks.run_chunk, label=f"pd-p{tp_rank}-xfer")
        self.bootstrap: BootstrapServer | None = None
        self.announced: str | None = None  # route_auth.announce_local_prefill's entry
        # rank 0 serves the bootstrap; on multi-node P the other nodes reach it at the
        # --dist-init-addr host (as in SGLang)
        boot_host = advertised_host(args.host)
        if args.nnodes > 1 and args.dist_init_addr:
            boot_host = args.dist_init_addr.rpartition(":")[0] or boot_host
        self.bootstrap_addr = f"{boot_host}:{args.disaggregation_bootstrap_port}"

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        addr = self.ctrl.start()
        if self.tp_rank == 0 and self.args.dp_rank == 0:  # one per server, every replica's
            self.bootstrap = BootstrapServer(self.args.host,
                                             self.args.disaggregation_bootstrap_port,
                                             self.token, self.route_secret,
                                             on_refused=self.claims.on_route_refused)
            self.bootstrap.start()
            # loopback routes to this port are trusted by this user's decode servers here
            self.announced = announce_local_prefill(self.bootstrap.port)
            host = self.bootstrap_addr.rpartition(":")[0]
            self.bootstrap_addr = f"{host}:{self.bootstrap.port}"
        host, _, port = addr.removeprefix("tcp://").rpartition(":")
        client = BootstrapClient(token=self.token, route_secret=self.route_secret)
        info = BootstrapInfo(
            tp_size=self.tp_size, dp_size=self.args.dp_size, page_size=self.kv.page_size,
            kv_cache_dtype=str(self.kv.dtype), is_mla=bool(self.kv.is_mla),
            total_kv_heads=int(self.kv.model_kv_heads), num_layers=self.kv.num_layers,
            head_dim=self.kv.head_dim, draft_layers=self.kv.draft_layers,
            model_fingerprint=self.fingerprint, **self.aux.chain_info(),
            backend=self.backend_name, protocol_version=wire.PROTOCOL_VERSION)
        route = RankRoute(host, int(port), self.tp_rank, self.args.dp_rank)
        client.put_route(self.bootstrap_addr, {**route.as_json(), **info.as_json()},
            # another replica's rank waits for replica 0's model load too
            attempts=30 if self.args.dp_rank == 0 else 240, interval=0.5)
        self.workers.start()
        log.info("prefill KV manager DP %d/%d rank %d/%d: control %s, bootstrap %s, backend %s",
                 self.args.dp_rank, self.args.dp_size, self.tp_rank, self.tp_size, addr,
                 self.bootstrap_addr, self.backend_name)

    def _shutdown(self) -> None:
        self.backend.close()  # unblocks workers waiting on in-flight writes
        self.workers.close()
        self.ctrl.close()
        if self.bootstrap is not None:
            withdraw_local_prefill(self.announced)
            self.bootstrap.close()
        if self.staging is not None:
            self.staging.close()

    # -- scheduler API ---------------------------------------------------------------------
    def add(self, room: int, bootstrap_host: str | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            if bootstrap_host == FAKE_BOOTSTRAP_HOST:
                self._rooms[room] = RoomState(room, deadline=float("inf"), fake=True)
                self.states.create(room, KVPoll.WaitingForInput)
                return
            if not self._claim(room):
                return
            r = RoomState(room, deadline=now + self.env.bootstrap_timeout,
                          claim_deadline=now + self.env.claim_timeout)
            self._rooms[room] = r
            self.states.create(room, KVPoll.Bootstrapping)
            self._tombstones.pop(room, None)
            pending = self._pending.pop(room, None)
            if pending is not None:
                r.dests, r.required = pending.dests, pending.required
                r.decode_id, r.claimed = pending.decode_id, bool(pending.claims or pending.dests)
                r.claimers = pending.claims
                for addr in [] if pending.failure else pending.claims:  # D waits for this
                    self.ctrl.send(addr, wire.Claimed(room=room, rank=self.tp_rank))
                if pending.failure:
                    self._fail(room, pending.failure, pending.failure_code)
                else:
                    self._maybe_ready(r)
        log.debug("room %d: added", room)

    def dest_page_count(self, room: int) -> int:
        return self.dests.page_count(room)

    def dest_prefix(self, room: int) -> tuple[int, str]:
        return self.dests.prefix(room)

    def dest_prompt(self, room: int) -> str | None:
        return self.dests.prompt(room)

    def refuse(self, room: int, reason: str, code: str) -> None:
        """Fail the room on both sides with a machine-readable code, before any page left."""
        self._fail(room, reason, code)

    def send(self, room: int, src_pages: np.ndarray, page_start: int, is_last: bool,
             aux_slot: int | None) -> None:
        pages = np.asarray(src_pages, dtype=np.int64).ravel()
        with self._lock:
            r = self._rooms.get(room)
            if r is None:  # released already; its poll() says Failed
                log.warning("room %d: send() for a room that is not (or no longer) added", room)
                return
            state = self.states.get(room)
            if r.fake:
                if is_last:
                    self.states.advance(room, KVPoll.Success)
                return
            if state is KVPoll.Failed:
                return  # the scheduler sees Failed on its next poll
            why = send_violation(r, state, pages, page_start, aux_slot if is_last else None,
                                 self.aux.num_slots)
            if why:  # our scheduler broke the protocol: fail the room (D is told), not P
                self._fail(room, why)
                return
            self.states.advance(room, KVPoll.Transferring)
            r.inflight += 1
            r.last_queued = is_last
            r.final_aux = aux_slot if is_last else None
            r.deadline = time.monotonic() + self.env.waiting_timeout
            key = next(iter(r.dests))
        self.workers.submit(key, Chunk(room, pages, page_start, is_last))

    def abort(self, room: int, reason: str) -> None:
        self._fail(room, f"aborted by prefill: {reason}", code="aborted")

    def release(self, room: int) -> None:
        with self._lock:
            self._pending.pop(room, None)
            if self.states.get(room) is KVPoll.Failed:
                self._tombstones[room] = (self.states.reason(room), time.monotonic())
            super().release(room)

    def _role_metrics(self) -> dict:
        out = {"sessions": len(self.sessions), "queued_chunks": self.workers.pending(),
               "pending_rooms": len(self._pending)}
        if self.bootstrap is not None:  # rank 0: its bootstrap port's closed connections
            out.update(self.bootstrap.connection_stats())
        return out

    def _refuse_room(self, room: int, why: str) -> None:
        with self._lock:
            if room not in self._rooms and room not in self._tombstones:
                p = self.claims.open_pending(room, "")
                p.failure = p.failure or why  # the scheduler's add() fails it at once
                return
        self._fail(room, why, wire.VERSION_MISMATCH, notify=False)

    # -- helpers ---------------------------------------------------------------------------
    def _notify_failed(self, r: RoomState, reason: str, code: str) -> None:
        with self._lock:  # every D rank that sent pages or claimed the room
            addrs = {d.ctrl_addr for d in r.dests.values()} | set(r.claimers)
        for addr in addrs:
            self.claims.reply_failed(addr, r.room, reason, code)

    def _maybe_ready(self, r: RoomState) -> None:
        if len(r.dests) >= r.required and self.states.advance(r.room, KVPoll.WaitingForInput):
            r.deadline = time.monotonic() + self.env.waiting_timeout
            log.debug("room %d: destination known (%d pages)", r.room,
                      min(len(d.pages) for d in r.dests.values()))

    # -- control plane (receive thread) ------------------------------------------------------
    def _on_hello(self, msg: wire.Hello) -> None:
        """D asks P to prove it holds the cluster secret before D reveals its memory: the
        answer is MACed (ControlPlane) and echoes D's fresh nonce."""
        self.ctrl.send(msg.ctrl_addr, wire.HelloAck(nonce=msg.nonce, rank=self.tp_rank))

    def _on_register(self, msg: wire.Register) -> None:
        try:
            sess = parse_register(msg, self.kv, self.backend_name, self.aux.row_bytes,
                                  self.planner, self.fingerprint, chain=self.aux.chain_info())
        except ProtocolError as e:
            self.sessions.refuse(msg.session, str(e))
            self.counters.add("rejected_registrations")
            self.counters.add("pairing_refused")
            log.warning("rejected registration of decode session %s: %s", msg.session, e)
            return
        if self.sessions.register(sess):  # False: the same D again, nothing new
            log.info("decode session %s (rank %d/%d, %d pages) registered", msg.session,
                     msg.rank, msg.tp_size, sess.layout.num_pages)

    def _on_abort(self, msg: wire.Abort) -> None:
        reason = f"aborted by decode: {msg.reason or 'no reason given'}"
        if msg.code == wire.PAIRING_REFUSED:
            self.counters.add("pairing_refused")
            log.warning("room %d: decode session %s refused to pair: %s", msg.room, msg.session,
                        msg.reason)
        with self._lock:
            r = self._rooms.get(msg.room)
            if r is None:
                if msg.room not in self._tombstones:
                    p = self.claims.open_pending(msg.room, self.claims.session_peer(msg.session))
                    p.failure = p.failure or reason
                ack_now = True
            else:
                ack_now = r.inflight == 0
                if not ack_now:  # ack once no write into D's pages is in flight any more
                    r.abort_acks.append(msg.ctrl_addr)
        self._fail(msg.room, reason, wire.DECODE_ABORT, notify=False)
        if ack_now:
            self.ctrl.send(msg.ctrl_addr, wire.AbortAck(room=msg.room, rank=self.tp_rank))

    def _on_tick(self) -> None:
        now = time.monotonic()
        stalled = f"waiting timeout: no transfer progress for {self.env.waiting_timeout:g}s"
        expired = self._expired(now, {
            KVPoll.Bootstrapping: (f"bootstrap timeout: decode sent no destination pages within "
                                   f"{self.env.bootstrap_timeout:g}s (decode could not "
                                   f"pre-allocate, never got the request, or is dead)"),
            KVPoll.WaitingForInput: stalled, KVPoll.Transferring: stalled})
        with self._lock:
            keep = self.env.bootstrap_entry_cleanup_interval
            for room in [k for k, p in self._pending.items() if now - p.created > keep]:
                del self._pending[room]
            for room in [k for k, t in self._tombstones.items() if now - t[1] > keep]:
                del self._tombstones[room]
        unclaimed = (f"claim timeout: no decode server claimed this room within "
                     f"{self.env.claim_timeout:g}s: decode refused the request (an untrusted "
                     "route? decode's answer says why) or never received it")
        with self._lock:
            late = [room for room, r in self._rooms.items() if not r.fake and not r.claimed
                    and now > r.claim_deadline and self.states.get(room) is KVPoll.Bootstrapping]
        for room, why in expired:
            self._fail(room, why)
        for room in late:
            self.counters.add("unclaimed_rooms")
            self._fail(room, unclaimed, wire.UNCLAIMED)
