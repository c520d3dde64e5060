"""Decode's watch over its prefill peers (mixed into DecodeKVManager): what the heartbeat's
verdicts do to the rooms.

- `_known_instances`: the addresses the heartbeat probes (each with the instance id it knew);
- `_lose(addr)`: P stopped answering: every unfinished room on it fails (PREFILL_FAULT);
- `_restarted(addr)`: another instance answers there: rooms the old one cannot have started on
  move to the new one (`_rebind`: a fresh bootstrap, then attach or resend TransferInfo), the
  others fail; a new TP size fails the rooms whose grants were sized for the old one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdcore.disagg import wire
from pdcore.disagg.decode.rooms import Instance, Room
from pdcore.disagg.states import TERMINAL, KVPoll
from pdcore.errors import PDError

log = logging.getLogger("pdcore.disagg.decode")


class PrefillPeerWatch:
    """The heartbeat-verdict half of DecodeKVManager (its attributes are the manager's)."""

    _lock: Any
    _rooms: dict[int, Room]
    _instances: dict[str, Instance]

    def _known_instances(self) -> dict[str, str]:
        with self._lock:
            return {a: i.instance_id for a, i in self._instances.items()}

    def _forget(self, addr: str, inst: Instance) -> None:
        with self._lock:
            if self._instances.get(addr) is not inst:
                return
            del self._instances[addr]
        for a in inst.ctrl_addrs.values():
            self.ctrl.drop(a)

    def _lose(self, addr: str, reason: str) -> None:
        """Heartbeat verdict: P at addr is gone (or restarted); fail everything waiting on it."""
        with self._lock:
            inst = self._instances.get(addr)
            if inst is None:
                return
            rooms = [room for room, r in self._rooms.items()
                     if r.inst is inst and self.states.get(room) not in TERMINAL]
        self._forget(addr, inst)
        self.counters.add("prefill_lost")
        log.warning("%s: failing %d unfinished rooms", reason, len(rooms))
        for room in rooms:
            self._fail(room, reason, code=wire.PREFILL_FAULT, notify=False)

    def _restarted(self, addr: str, reason: str) -> None:
        """Heartbeat verdict: another instance answers at addr. Rooms the old instance cannot
        have started on (nothing sent to it yet, or sent only once it was unreachable, and no
        Status from it) move to the new instance; the others lost their KV and fail."""
        down = self.heartbeat.down_since(addr)
        with self._lock:  # one section: add() must not attach to the old instance after this
            old = self._instances.pop(addr, None)
            if old is None:
                return
            movable, lost = [], []
            for room, r in self._rooms.items():
                if r.inst is not old or self.states.get(room) in TERMINAL:
                    continue
                unserved = not r.responders and not r.staged_by and (
                    r.sent_at is None or (down is not None and r.sent_at >= down))
                if unserved:
                    r.rebinding = True
                    movable.append(r)
                else:
                    lost.append(room)
        for a in old.ctrl_addrs.values():
            self.ctrl.drop(a)
        self.counters.add("prefill_restarts")
        log.warning("%s: failing %d rooms it had started, moving %d to the new instance", reason,
                    len(lost), len(movable))
        for room in lost:
            self._fail(room, reason, code=wire.PREFILL_FAULT, notify=False)
        if movable:
            self._resolver.submit(self._rebind, addr, old, movable, reason)

    def _rebind(self, addr: str, old: Instance, rooms: list[Room], reason: str) -> None:
        """Resolve and register with the new instance at addr (a fresh bootstrap), then give it
        the rooms: WaitingForInput ones attach, Transferring ones get their TransferInfo."""
        try:
            inst = self._instance(addr, time.monotonic())
        except PDError as e:
            for r in rooms:
                with self._lock:
                    r.rebinding = False
                    mine = self._rooms.get(r.room) is r
                if mine:
                    self._fail(r.room, f"cannot bootstrap with prefill {addr} after it "
                                       f"restarted: {e}",
                               code=wire.PREFILL_FAULT, notify=False)
            return
        send: list[Room] = []
        with self._lock:
            for r in rooms:
                r.rebinding = False
                if self._rooms.get(r.room) is not r:  # released meanwhile
                    continue
                state = self.states.get(r.room)
                if state is KVPoll.Failed:  # failed while re-resolving: the new P may hold it
                    self._send_abort(r, inst, self.states.reason(r.room))
                elif state in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                    self._attach(r, inst)  # a room not confirmed yet claims it again there
                elif state is KVPoll.Transferring and inst.tp_size != old.tp_size:
                    self._fail(r.room, f"{reason} with TP {inst.tp_size} (was {old.tp_size})",
                               code=wire.PREFILL_FAULT, notify=False)  # its grant is sized for TP
                elif state is KVPoll.Transferring:  # sent nothing yet, or only to a dead instance
                    r.inst = inst
                    r.responders.clear()
                    r.staged_by.clear()
                    if r.dst_pages is not None and (r.grant is not None or not self._staged(inst)):
                        send.append(r)  # else _on_tick sends it once the ring has room
        self.counters.add("rooms_moved_after_restart", len(rooms))
        for r in send:
            self._send_info(r)
