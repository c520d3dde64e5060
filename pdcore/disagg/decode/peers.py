"""Which prefill instance each of D's rooms pulls from (a part of DecodeKVManager): bound when
its address resolves, claimed there, confirmed, and moved or failed on the heartbeat's verdicts.

- `resolve_later(room, addr)` (a resolver thread): the instance through the directory
  (decode/resolve.py), then `attach`: the room sends P a Claim and waits, holding no page, for
  P's Claimed from every P rank it pulls from (`on_claimed`: WaitingForInput); a room P never
  confirms (a request sent to D alone) fails after CONFIRM_FACTOR claim timeouts;
- `lose(addr)`: P stopped answering: every unfinished room on it fails (PREFILL_FAULT);
- `restarted(addr)`: another instance answers there: rooms the old one cannot have started on
  move to the new one (`_rebind`: a fresh bootstrap, then attach or resend TransferInfo), the
  others fail; a new TP size fails the rooms whose grants were sized for the old one.

It owns its resolver threads; the rooms, their states and the lock are the manager's (one
section changes a room and what it binds to); what it asks of the manager is three calls:
`fail` a room, `send_info` (TransferInfo to the room's instance), `staged` (whether KV from an
instance goes through the staging ring).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdcore.config import DisaggEnv
from pdcore.disagg import wire
from pdcore.disagg.common import Counters
from pdcore.disagg.control import ControlPlane
from pdcore.disagg.decode.resolve import Pairing, PairingRefused, PrefillDirectory
from pdcore.disagg.decode.rooms import Instance, Room
from pdcore.disagg.states import TERMINAL, KVPoll, RoomStates
from pdcore.errors import PDError

log = logging.getLogger("pdcore.disagg.decode")
# D waits this many claim timeouts for P's Claimed: P admits a request between two forward
# passes (one long prefill chunk can delay it), and the waiting room holds no page meanwhile
CONFIRM_FACTOR = 6


class PrefillBinding:
    """Binds each of D's rooms to the prefill instance it pulls from, and keeps it bound."""

    def __init__(self, *, lock: Any, rooms: dict[int, Room], states: RoomStates,
                 prefills: PrefillDirectory, ctrl: ControlPlane, counters: Counters,
                 env: DisaggEnv, me: Pairing, decode_id: str,
                 fail: Callable[..., None], send_info: Callable[[Room], None],
                 staged: Callable[[Instance], bool],
                 down_since: Callable[[str], float | None]) -> None:
        self._lock, self._rooms, self.states, self.prefills = lock, rooms, states, prefills
        self._ctrl, self._counters, self._env, self._me = ctrl, counters, env, me
        self._decode_id = decode_id
        self._fail, self._send_info, self._staged = fail, send_info, staged
        self._down_since = down_since
        self._resolver = ThreadPoolExecutor(4, thread_name_prefix=f"pd-d{me.tp_rank}-resolve")

    def close(self) -> None:
        self._resolver.shutdown(wait=False, cancel_futures=True)

    # -- binding a room --------------------------------------------------------------------------
    def resolve_later(self, room: int, addr: str, started: float) -> None:
        self._resolver.submit(self._resolve, room, addr, started)

    def _resolve(self, room: int, addr: str, started: float) -> None:
        for _ in range(2):  # twice: the instance may be forgotten (restart) before we attach
            try:
                inst = self.prefills.resolve(addr, started)
            except PDError as e:
                reason = f"cannot bootstrap with prefill {addr}: {e}"
                if isinstance(e, PairingRefused):  # P's room fails now too, saying why
                    self._abort_refused(room, e, reason)
                self._fail(room, reason, code=wire.PREFILL_FAULT, notify=False)
                return
            with self._lock:
                r = self._rooms.get(room)
                if r is not None and self.prefills.get(addr) is inst:
                    self.attach(r, inst)
                    return
                if r is None:
                    return
        self._fail(room, f"prefill {addr} restarted twice while resolving it",
                   code=wire.PREFILL_FAULT, notify=False)

    def attach(self, r: Room, inst: Instance) -> None:
        """Under the lock: `r` pulls from `inst` (claimed there if P has not confirmed it)."""
        if r.prefill_dp is not None and not 0 <= r.prefill_dp < inst.dp_size:
            self._fail(r.room, f"disagg_prefill_dp_rank {r.prefill_dp} is out of range: prefill "
                               f"{r.addr} has --dp-size {inst.dp_size}", notify=False)
            return
        r.inst = inst
        state = self.states.get(r.room)
        if state is KVPoll.Failed:  # aborted while resolving: tell P now
            self.send_abort(r, inst, self.states.reason(r.room))
        elif state is KVPoll.Bootstrapping:  # claim the room; pages wait for P's Claimed
            r.confirmed.clear()
            r.deadline = time.monotonic() + CONFIRM_FACTOR * self._env.claim_timeout
            self._send_claim(r, inst)
            log.debug("room %d: prefill %s resolved, room claimed", r.room, r.addr)
        else:  # moved to a restarted prefill after P had confirmed it
            r.deadline = time.monotonic() + self._env.waiting_timeout

    def _send_claim(self, r: Room, inst: Instance) -> None:
        msg = wire.Claim(room=r.room, session=self._me.session, ctrl_addr=self._ctrl.addr,
                         rank=self._me.tp_rank, decode_id=self._decode_id)
        dp = r.prefill_dp_of(inst)
        for t in inst.targets:
            if not self._ctrl.send(inst.ctrl_addrs[(dp, t)], msg):
                self._fail(r.room, f"cannot reach prefill rank at {inst.ctrl_addrs[(dp, t)]}",
                           code=wire.PREFILL_FAULT, notify=False)
                return

    def on_claimed(self, msg: wire.Claimed) -> None:
        """P has the room's request: once every P rank this rank pulls from said so, the
        scheduler may reserve its pages (WaitingForInput)."""
        with self._lock:
            r = self._rooms.get(msg.room)
            if (r is None or r.inst is None or msg.rank not in r.inst.targets
                    or self.states.get(msg.room) is not KVPoll.Bootstrapping):
                self._counters.add("stale_messages")
                return
            r.confirmed.add(msg.rank)
            if len(r.confirmed) < len(r.inst.targets):
                return
            r.deadline = time.monotonic() + self._env.waiting_timeout
            self.states.advance(msg.room, KVPoll.WaitingForInput)

    def send_abort(self, r: Room, inst: Instance, reason: str) -> None:
        """Tell the P ranks `r` pulls from on `inst` that it failed here."""
        msg = wire.Abort(room=r.room, session=self._me.session, ctrl_addr=self._ctrl.addr,
                         reason=reason)
        dp = r.prefill_dp_of(inst)
        for t in inst.targets:
            self._ctrl.send(inst.ctrl_addrs[(dp, t)], msg)

    def _abort_refused(self, room: int, e: PairingRefused, reason: str) -> None:
        msg = wire.Abort(room=room, session=self._me.session, ctrl_addr=self._ctrl.addr,
                         reason=reason, code=wire.PAIRING_REFUSED)
        for a in e.ctrl_addrs:
            self._ctrl.send(a, msg)

    # -- the heartbeat's verdicts ----------------------------------------------------------------
    def lose(self, addr: str, reason: str) -> None:
        """P at addr is gone (or restarted); fail everything waiting on it."""
        with self._lock:
            inst = self.prefills.get(addr)
            if inst is None:
                return
            rooms = [room for room, r in self._rooms.items()
                     if r.inst is inst and self.states.get(room) not in TERMINAL]
        self.prefills.forget(addr, inst)
        self._counters.add("prefill_lost")
        log.warning("%s: failing %d unfinished rooms", reason, len(rooms))
        for room in rooms:
            self._fail(room, reason, code=wire.PREFILL_FAULT, notify=False)

    def restarted(self, addr: str, reason: str) -> None:
        """Another instance answers at addr. Rooms the old instance cannot have started on
        (nothing sent to it yet, or sent only once it was unreachable, and no Status from it)
        move to the new instance; the others lost their KV and fail."""
        down = self._down_since(addr)
        with self._lock:  # one section: add() must not attach to the old instance after this
            old = self.prefills.pop(addr)
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
        self.prefills.drop_connections(old)
        self._counters.add("prefill_restarts")
        log.warning("%s: failing %d rooms it had started, moving %d to the new instance", reason,
                    len(lost), len(movable))
        for room in lost:
            self._fail(room, reason, code=wire.PREFILL_RESTARTED, notify=False)
        if movable:
            self._resolver.submit(self._rebind, addr, old, movable, reason)

    def _rebind(self, addr: str, old: Instance, rooms: list[Room], reason: str) -> None:
        """Resolve and register with the new instance at addr (a fresh bootstrap), then give it
        the rooms: WaitingForInput ones attach, Transferring ones get their TransferInfo."""
        try:
            inst = self.prefills.resolve(addr, time.monotonic())
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
                    self.send_abort(r, inst, self.states.reason(r.room))
                elif state in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                    self.attach(r, inst)  # a room not confirmed yet claims it again there
                elif state is KVPoll.Transferring and inst.tp_size != old.tp_size:
                    self._fail(r.room, f"{reason} with TP {inst.tp_size} (was {old.tp_size})",
                               code=wire.PREFILL_FAULT, notify=False)  # its grant is sized for TP
                elif state is KVPoll.Transferring:  # sent nothing yet, or only to a dead instance
                    r.inst = inst
                    r.responders.clear()
                    r.staged_by.clear()
                    if r.dst_pages is not None and (r.grant is not None
                                                    or not self._staged(inst)):
                        send.append(r)  # else _on_tick sends it once the ring has room
        self._counters.add("rooms_moved_after_restart", len(rooms))
        for r in send:
            self._send_info(r)
