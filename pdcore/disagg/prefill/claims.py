"""Which decode server a room belongs to (mixed into PrefillKVManager; issue 44 items 1 and 7).

D sends a Claim for a room when it admits the request: P binds the room to that decode server
(its server id, every rank of it) and answers Claimed once P has the request too; D reserves
no page before that, so a request sent to D alone never holds D's pool. A Claim or
TransferInfo from another decode server for a bound room (a copied route) gets Status(Failed,
ROOM_CLAIMED) and nothing else: the room goes on. A room no decode server claims within the
claim timeout fails (PrefillKVManager._on_tick): D refused its route or never got it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pdcore.disagg import wire
from pdcore.disagg.prefill.rooms import Pending, RoomState
from pdcore.disagg.states import KVPoll

log = logging.getLogger("pdcore.disagg.prefill")
MAX_CLAIMS = 64  # D ranks a room waits to confirm before P has it (one per rank of one D)


class RoomClaims:
    """The claim half of PrefillKVManager (its attributes are the manager's)."""

    _lock: threading.RLock
    _rooms: dict[int, RoomState]
    _pending: dict[int, Pending]
    _tombstones: dict[int, tuple[str, float]]
    states: Any
    counters: Any
    ctrl: Any
    tp_rank: int

    def _on_claim(self, msg: wire.Claim) -> None:
        """A decode server admitted the room's request: bind the room to it and confirm once
        this server has the request too (D reserves no page before that)."""
        with self._lock:
            r = self._rooms.get(msg.room)
            holder = r if r is not None else self._pending.get(msg.room)
            if holder is not None and holder.decode_id and holder.decode_id != msg.decode_id:
                self._refuse_claim(msg)
                return
            if r is None:
                tomb = self._tombstones.get(msg.room)
                if tomb is not None:
                    self._reply_failed(msg.ctrl_addr, msg.room, tomb[0])
                    return
                p = self._pending.setdefault(msg.room, Pending(time.monotonic()))
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
            self._reply_failed(msg.ctrl_addr, msg.room, reason)
        else:
            self.ctrl.send(msg.ctrl_addr, wire.Claimed(room=msg.room, rank=self.tp_rank))

    def _refuse_claim(self, msg: wire.TransferInfo | wire.Claim) -> None:
        """Under the lock: a second decode server names a room that is bound to another one (a
        copied route): only it is told, nothing moves, the room goes on."""
        self.counters.add("room_claims_refused")
        why = (f"bootstrap room {msg.room} is bound to another decode server (one decode "
               "server per room): this request's route was copied from another request")
        log.warning("room %d: TransferInfo from decode %s refused: bound to another decode "
                    "server", msg.room, msg.decode_id or msg.session)
        self._reply_failed(msg.ctrl_addr, msg.room, why, wire.ROOM_CLAIMED)
