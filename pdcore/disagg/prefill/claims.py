"""Which decode server a room belongs to (`RoomClaims`, a part of PrefillKVManager; issue 44
items 1 and 7).

D sends a Claim for a room when it admits the request: P binds the room to that decode server
(its server id, every rank of it) and answers Claimed once P has the request too; D reserves
no page before that, so a request sent to D alone never holds D's pool. A Claim or
TransferInfo from another decode server for a bound room (a copied route) gets Status(Failed,
ROOM_CLAIMED) and nothing else: the room goes on. A room no decode server claims within the
claim timeout fails (PrefillKVManager._on_tick): D refused its route or never got it. A decode
server that refused the route says so at once (`POST /refused` on the bootstrap port,
pdcore/route_refusal.py): an unclaimed room then fails with code route_refused (P answers 403
with D's reason), before P added it too; a claimed room goes on (it is its decode server's).

What P keeps for rooms it has no request for yet (Pending: claims, early pages) is bounded
(rooms.PendingTable): MAX_PENDING_PER_PEER per decode server, MAX_PENDING in all, the oldest
evicted first; each decode rank waiting on an evicted room gets Status(Failed,
PENDING_EVICTED) at once (its client a 502), and `pending_evicted` counts them
(pdserve_scheduler_kv_pending_evicted_total; pdserve_scheduler_kv_pending_rooms is the gauge).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pdcore.disagg import wire
from pdcore.disagg.common import Counters
from pdcore.disagg.prefill.rooms import Dest, Pending, PendingTable, RoomState
from pdcore.disagg.prefill.sessions import SessionTable
from pdcore.disagg.states import KVPoll, RoomStates
from pdcore.route_refusal import DECODE_REFUSED

log = logging.getLogger("pdcore.disagg.prefill")
MAX_CLAIMS = 64  # D ranks a room waits to confirm before P has it (one per rank of one D)
# rooms P holds early messages for (before it has their request): a decode server's share and
# the whole table. A real room waits there for moments (P's request is on its way); a D admits
# at most its running requests at once, far below either bound
MAX_PENDING_PER_PEER = 2048
MAX_PENDING = 8192
REFUSALS_PEER = "(refused routes)"  # the pending table's quota for early refusal notices


class RoomClaims:
    """Binds P's rooms to the decode server that claimed them (Claim, TransferInfo), keeps what
    comes for rooms P has no request for yet, and fails rooms decode refused. It shares the
    manager's lock and tables; `fail` is the manager's (a room failed on both sides),
    `ready` moves a room whose destinations are all known on."""

    def __init__(self, *, lock: threading.RLock, rooms: dict[int, RoomState],
                 pending: PendingTable, tombstones: dict[int, tuple[str, float]],
                 sessions: SessionTable, states: RoomStates, counters: Counters, ctrl: Any,
                 tp_rank: int, fail: Callable[..., None],
                 ready: Callable[[RoomState], None]) -> None:
        self._lock, self._rooms, self._pending = lock, rooms, pending
        self._tombstones, self._sessions, self.states = tombstones, sessions, states
        self.counters, self.ctrl, self.tp_rank = counters, ctrl, tp_rank
        self._fail, self._ready = fail, ready

    def reply_failed(self, addr: str, room: int, reason: str, code: str = "") -> None:
        self.ctrl.send(addr, wire.Status(room=room, state=int(KVPoll.Failed), rank=self.tp_rank,
                                         reason=reason, code=code))

    def on_transfer_info(self, msg: wire.TransferInfo) -> None:
        """A D rank's destination pages for a room: kept with the room (or, before P has the
        request, in its pending entry); the room moves on once every D rank's is known."""
        with self._lock:
            code, why, pages = self._sessions.check(msg)
            dest = Dest(msg.session, msg.ctrl_addr, msg.rank, pages, msg.aux_slot,
                        msg.staging_offset, msg.staging_len, prefix_pages=msg.prefix_pages,
                        prefix_digest=msg.prefix_digest, prompt_digest=msg.prompt_digest)
            r = self._rooms.get(msg.room)
            holder = r if r is not None else self._pending.get(msg.room)
            if holder is not None and holder.decode_id and holder.decode_id != msg.decode_id:
                self.refuse_claim(msg)  # the room stays its first decode server's
                return
            if r is None:
                tomb = self._tombstones.get(msg.room)
                if tomb is not None:
                    why = why or tomb[0]
                else:
                    p = self.open_pending(msg.room, msg.decode_id or msg.ctrl_addr)
                    p.required = msg.required
                    p.decode_id = p.decode_id or msg.decode_id
                    if why:
                        p.failure = p.failure or why
                    else:
                        p.dests[msg.session] = dest
                if why:
                    self.reply_failed(msg.ctrl_addr, msg.room, why, code)
                return
            r.dests[msg.session] = dest
            r.required = msg.required
            r.decode_id, r.claimed = r.decode_id or msg.decode_id, True
            if self.states.get(msg.room) is KVPoll.Failed:
                self.reply_failed(msg.ctrl_addr, msg.room, self.states.reason(msg.room))
                return
        if why:
            log.warning("room %d: invalid transfer info from %s: %s", msg.room, msg.session, why)
            self._fail(msg.room, why, code)
            return
        self._ready(r)

    def on_claim(self, msg: wire.Claim) -> None:
        """A decode server admitted the room's request: bind the room to it and confirm once
        this server has the request too (D reserves no page before that)."""
        with self._lock:
            r = self._rooms.get(msg.room)
            holder = r if r is not None else self._pending.get(msg.room)
            if holder is not None and holder.decode_id and holder.decode_id != msg.decode_id:
                self.refuse_claim(msg)
                return
            if r is None:
                tomb = self._tombstones.get(msg.room)
                if tomb is not None:
                    self.reply_failed(msg.ctrl_addr, msg.room, tomb[0])
                    return
                p = self.open_pending(msg.room, msg.decode_id or msg.ctrl_addr)
                p.decode_id = p.decode_id or msg.decode_id
                if len(p.claims) < MAX_CLAIMS and msg.ctrl_addr not in p.claims:
                    p.claims.append(msg.ctrl_addr)
                return
            r.decode_id, r.claimed = r.decode_id or msg.decode_id, True
            if len(r.claimers) < MAX_CLAIMS and msg.ctrl_addr not in r.claimers:
                r.claimers.append(msg.ctrl_addr)
            failed = self.states.get(msg.room) is KVPoll.Failed
            reason = self.states.reason(msg.room) if failed else ""
        if failed:
            self.reply_failed(msg.ctrl_addr, msg.room, reason)
        else:
            self.ctrl.send(msg.ctrl_addr, wire.Claimed(room=msg.room, rank=self.tp_rank))

    def refuse_claim(self, msg: wire.TransferInfo | wire.Claim) -> None:
        """Under the lock: a second decode server names a room that is bound to another one (a
        copied route): only it is told, nothing moves, the room goes on."""
        self.counters.add("room_claims_refused")
        why = (f"bootstrap room {msg.room} is bound to another decode server (one decode "
               "server per room): this request's route was copied from another request")
        log.warning("room %d: TransferInfo from decode %s refused: bound to another decode "
                    "server", msg.room, msg.decode_id or msg.session)
        self.reply_failed(msg.ctrl_addr, msg.room, why, wire.ROOM_CLAIMED)

    def open_pending(self, room: int, peer: str) -> Pending:
        """Under the lock: the room's Pending entry, opened for `peer` (a decode server) if
        new; what that evicts is failed on the decode ranks waiting on it (module doc)."""
        p, evicted = self._pending.open(room, peer, time.monotonic())
        for old, q in evicted:
            self.counters.add("pending_evicted")
            why = (f"prefill dropped bootstrap room {old}: it holds too many rooms whose "
                   f"request it has not received ({self._pending.per_peer} per decode server, "
                   f"{self._pending.total} in all), this one the oldest (its request never "
                   "reached prefill?)")
            if self._pending.evicted % 1000 == 1:  # the first, then one in a thousand
                log.warning("room %d: %s", old, why)
            for addr in {d.ctrl_addr for d in q.dests.values()} | set(q.claims):
                self.reply_failed(addr, old, why, wire.PENDING_EVICTED)
        return p

    @staticmethod
    def session_peer(session: str) -> str:
        """The decode server of a D session name (host/server id/rank/...)."""
        parts = session.split("/")
        return parts[1] if len(parts) > 2 else session

    def on_route_refused(self, room: int, reason: str) -> bool:
        """A decode server refused this room's route (bootstrap thread): fail the room now
        unless a decode server claimed it; a room P has not added yet fails when it is.
        True when the room failed (or will, once added)."""
        why = f"{DECODE_REFUSED}: {reason}"
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                if room in self._tombstones:
                    return False
                # refusals share one quota of the pending table (its oldest go first)
                p = self._pending.get(room) or self.open_pending(room, REFUSALS_PEER)
                if p.decode_id or p.claims or p.dests:  # a decode server has it
                    return False
                p.failure, p.failure_code = p.failure or why, p.failure_code or wire.ROUTE_REFUSED
            elif r.fake or r.claimed or self.states.get(room) is not KVPoll.Bootstrapping:
                return False
        self.counters.add("refused_rooms")
        log.warning("room %d: %s", room, why)
        if r is not None:
            self._fail(room, why, wire.ROUTE_REFUSED)
        return True
