"""Decode's side of bootstrapping with a prefill instance (mixed into DecodeKVManager).

Lifecycle of one prefill address (resolver threads, one fetch per address at a time):
1. `_instance(addr)`: the cached Instance, or a fresh `_fetch`; a failed fetch is remembered so
   the rooms queued behind it fail at once with the same error;
2. `_fetch`: P's instance info from its bootstrap server (protocol version, backend), the
   control addresses of the P ranks this D rank needs, then what must match before KV crosses
   (`wire.check_pairing`: model fingerprint, page size, KV dtype, layout, the draft head's chain
   start in the aux rows) - a mismatch fails the
   pairing (PairingRefused: P's rooms are aborted with the reason, counted on both sides);
3. `_challenge` per P rank when a cluster secret is set: P answers a fresh nonce with a MACed
   HelloAck before D sends Register (its data-plane endpoint and KV addresses);
4. Register to every P rank; `_attach` the rooms waiting on the address: each sends P a Claim
   and waits, holding no page, for P's Claimed (P has the request: WaitingForInput); a room
   P never confirms (a request sent to D alone) fails after CONFIRM_FACTOR claim timeouts.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from pdcore.disagg import wire
from pdcore.disagg.decode.rooms import Instance, Room
from pdcore.disagg.states import KVPoll
from pdcore.errors import PDError, ProtocolError, TransferError
from pdcore.interfaces.geometry import rank_mapping

log = logging.getLogger("pdcore.disagg.decode")
# D waits this many claim timeouts for P's Claimed: P admits a request between two forward
# passes (one long prefill chunk can delay it), and the waiting room holds no page meanwhile
CONFIRM_FACTOR = 6


class PairingRefused(ProtocolError):
    """P and D must not pair (another model, page size, dtype or layout); `ctrl_addrs` are
    P's ranks, told through an Abort so P's side of the room fails with the same reason."""

    def __init__(self, message: str, ctrl_addrs: list[str]) -> None:
        super().__init__(message)
        self.ctrl_addrs = ctrl_addrs


class BootstrapResolution:
    """The resolver half of DecodeKVManager (its attributes are the manager's)."""

    _lock: Any
    _rooms: dict[int, Room]
    _instances: dict[str, Instance]

    def _resolve(self, room: int, addr: str, started: float) -> None:
        for _ in range(2):  # twice: the instance may be forgotten (restart) before we attach
            try:
                inst = self._instance(addr, started)
            except PDError as e:
                reason = f"cannot bootstrap with prefill {addr}: {e}"
                if isinstance(e, PairingRefused):  # P's room fails now too, saying why
                    self._abort_refused(room, e, reason)
                self._fail(room, reason, code=wire.PREFILL_FAULT, notify=False)
                return
            with self._lock:
                r = self._rooms.get(room)
                if r is not None and self._instances.get(addr) is inst:
                    self._attach(r, inst)
                    return
                if r is None:
                    return
        self._fail(room, f"prefill {addr} restarted twice while resolving it",
                   code=wire.PREFILL_FAULT, notify=False)

    def _attach(self, r: Room, inst: Instance) -> None:
        if r.prefill_dp is not None and not 0 <= r.prefill_dp < inst.dp_size:
            self._fail(r.room, f"disagg_prefill_dp_rank {r.prefill_dp} is out of range: prefill "
                               f"{r.addr} has --dp-size {inst.dp_size}", notify=False)
            return
        r.inst = inst
        state = self.states.get(r.room)
        if state is KVPoll.Failed:  # aborted while resolving: tell P now
            self._send_abort(r, inst, self.states.reason(r.room))
        elif state is KVPoll.Bootstrapping:  # claim the room; pages wait for P's Claimed
            r.confirmed.clear()
            r.deadline = time.monotonic() + CONFIRM_FACTOR * self.env.claim_timeout
            self._send_claim(r, inst)
            log.debug("room %d: prefill %s resolved, room claimed", r.room, r.addr)
        else:  # moved to a restarted prefill after P had confirmed it
            r.deadline = time.monotonic() + self.env.waiting_timeout

    def _send_claim(self, r: Room, inst: Instance) -> None:
        msg = wire.Claim(room=r.room, session=self.session, ctrl_addr=self.ctrl.addr,
                         rank=self.tp_rank, decode_id=self.decode_id)
        dp = r.prefill_dp_of(inst)
        for t in inst.targets:
            if not self.ctrl.send(inst.ctrl_addrs[(dp, t)], msg):
                self._fail(r.room, f"cannot reach prefill rank at {inst.ctrl_addrs[(dp, t)]}",
                           code=wire.PREFILL_FAULT, notify=False)
                return

    def _on_claimed(self, msg: wire.Claimed) -> None:
        """P has the room's request: once every P rank this rank pulls from said so, the
        scheduler may reserve its pages (WaitingForInput)."""
        with self._lock:
            r = self._rooms.get(msg.room)
            if (r is None or r.inst is None or msg.rank not in r.inst.targets
                    or self.states.get(msg.room) is not KVPoll.Bootstrapping):
                self.counters.add("stale_messages")
                return
            r.confirmed.add(msg.rank)
            if len(r.confirmed) < len(r.inst.targets):
                return
            r.deadline = time.monotonic() + self.env.waiting_timeout
            self.states.advance(msg.room, KVPoll.WaitingForInput)

    def _instance(self, addr: str, started: float) -> Instance:
        with self._lock:
            lock = self._addr_locks.setdefault(addr, threading.Lock())
        with lock:  # one fetch per address; rooms queued behind a failed fetch fail at once
            with self._lock:
                inst = self._instances.get(addr)
                if inst is not None:
                    return inst
                failure = self._last_failure.get(addr)
                if failure is not None and failure[0] >= started:
                    raise failure[1]
            try:
                inst = self._fetch(addr)
            except PDError as e:
                with self._lock:
                    self._last_failure[addr] = (time.monotonic(), e)
                raise
            with self._lock:
                self._instances[addr] = inst
                self._last_failure.pop(addr, None)
            return inst

    def _fetch(self, addr: str) -> Instance:
        budget = max(1.0, self.env.heartbeat_interval * self.env.heartbeat_max_failure)
        interval = min(1.0, budget / 5)
        attempts, deadline = int(budget / interval) + 1, time.monotonic() + budget
        info = self.client.get_info(addr, attempts, interval, deadline)
        version = info.get("protocol_version")
        if version is not None and version != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"prefill {addr} speaks PD protocol version {version}, decode "
                                f"speaks {wire.PROTOCOL_VERSION}; run the same pdserve version")
        if info.get("backend") and info["backend"] != self.backend_name:
            raise ProtocolError(f"prefill {addr} uses transfer backend {info['backend']!r}, "
                                f"decode uses {self.backend_name!r}; give both the same "
                                "--disaggregation-transfer-backend (the default is mooncake "
                                "where pd-mooncake is installed, else tcp)")
        targets, required_dst, responses = rank_mapping(
            int(info["tp_size"]), self.tp_size, self.tp_rank, bool(info.get("is_mla")))
        dp_size, inst_id = int(info.get("dp_size") or 1), str(info.get("instance_id", ""))
        ctrl: dict[tuple[int, int], str] = {}
        for dp in range(dp_size):
            for t in targets:  # every route from the instance the info came from, or none
                ip, port = self.client.get_rank(addr, dp, t, attempts, interval, deadline,
                                                 instance=inst_id)
                ctrl[(dp, t)] = f"tcp://{ip}:{port}"
        try:
            wire.check_pairing(f"prefill {addr}", info, self.kv, self.fingerprint,
                               self.aux.chain_info())
        except ProtocolError as e:
            self.counters.add("pairing_refused")
            raise PairingRefused(str(e), list(ctrl.values())) from None
        assert self._register is not None, "start() must run before add()"
        for a in ctrl.values():
            self._challenge(a, budget)
            if not self.ctrl.send(a, self._register):
                raise TransferError(f"cannot reach prefill rank at {a} to register")
        self.counters.add("registrations", len(ctrl))
        log.info("registered with prefill %s (instance %s, P DP %d x TP %s -> ranks %s)", addr,
                 info.get("instance_id"), dp_size, info["tp_size"], targets)
        return Instance(addr, inst_id, dp_size, int(info["tp_size"]),
                         targets, required_dst, responses, ctrl)

    def _challenge(self, addr: str, budget: float) -> None:
        """With a cluster secret, the prefill rank at addr must answer a fresh nonce with a
        MACed HelloAck before D sends it anything that reveals its memory (Register: the
        data-plane endpoint and KV addresses). Without one there is nothing to prove: the route
        itself was signed or trusted at D's HTTP edge."""
        if not self.token:
            return
        nonce, done = uuid.uuid4().hex, threading.Event()
        with self._lock:
            self._hellos[nonce] = done
        try:
            wait = min(max(1.0, budget), 10.0)
            if not self.ctrl.send(addr, wire.Hello(nonce=nonce, session=self.session,
                                                   ctrl_addr=self.ctrl.addr)) \
                    or not done.wait(wait):
                self.counters.add("pairing_refused")
                raise TransferError(
                    f"prefill rank at {addr} did not prove within {wait:g}s that it holds the "
                    "cluster secret (another --disaggregation-auth-token, or not a pdserve "
                    "prefill server); nothing was sent to it")
        finally:
            with self._lock:
                self._hellos.pop(nonce, None)

    def _abort_refused(self, room: int, e: PairingRefused, reason: str) -> None:
        msg = wire.Abort(room=room, session=self.session, ctrl_addr=self.ctrl.addr,
                         reason=reason, code=wire.PAIRING_REFUSED)
        for a in e.ctrl_addrs:
            self.ctrl.send(a, msg)

    def _on_hello_ack(self, msg: wire.HelloAck) -> None:
        with self._lock:
            done = self._hellos.get(msg.nonce)
        if done is None:
            self.counters.add("stale_messages")
            return
        done.set()
