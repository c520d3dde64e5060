"""Decode's directory of prefill instances (a part of DecodeKVManager): the prefill instances
this D rank knows, by bootstrap address, and how one becomes known.

Lifecycle of one prefill address (resolver threads, one fetch per address at a time):
1. `resolve(addr)`: the cached Instance, or a fresh `_fetch`; a failed fetch is remembered so
   the rooms queued behind it fail at once with the same error;
2. `_fetch`: P's instance info from its bootstrap server (protocol version, backend), the
   control addresses of the P ranks this D rank needs, then what must match before KV crosses
   (`wire.check_pairing`: model fingerprint, page size, KV dtype, layout, the draft head's chain
   start in the aux rows) - a mismatch fails the
   pairing (PairingRefused: P's rooms are aborted with the reason, counted on both sides);
3. `_challenge` per P rank when a cluster secret is set: P answers a fresh nonce with a MACed
   HelloAck before D sends Register (its data-plane endpoint and KV addresses);
4. Register to every P rank; the instance is kept until the heartbeat or P itself drops it
   (`forget`, `pop`). Which rooms pull from which instance is decode/peers.py's `PrefillBinding`.

Its state is its own (instances, per-address fetch locks, remembered failures, pending Hello
nonces); the lock is the manager's, so that a room and the instance it binds to change in one
section (`PrefillBinding.restarted`: add() must not attach to an instance being replaced).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pdcore.config import DisaggEnv
from pdcore.disagg import wire
from pdcore.disagg.bootstrap import BootstrapClient
from pdcore.disagg.common import Counters
from pdcore.disagg.control import ControlPlane
from pdcore.disagg.decode.rooms import Instance
from pdcore.errors import PDError, ProtocolError, TransferError
from pdcore.interfaces.geometry import rank_mapping
from pdcore.interfaces.planner import KVLayout

log = logging.getLogger("pdcore.disagg.decode")


class PairingRefused(ProtocolError):
    """P and D must not pair (another model, page size, dtype or layout); `ctrl_addrs` are
    P's ranks, told through an Abort so P's side of the room fails with the same reason."""

    def __init__(self, message: str, ctrl_addrs: list[str]) -> None:
        super().__init__(message)
        self.ctrl_addrs = ctrl_addrs


@dataclass(frozen=True)
class Pairing:
    """What this D rank is to the prefill instances it pairs with (checked against P's info)."""

    session: str
    tp_rank: int
    tp_size: int
    backend_name: str
    kv: KVLayout
    fingerprint: str
    chain: dict[str, Any]  # AuxBuffers.chain_info(): the draft head's chain start in the rows
    token: str | None  # the cluster secret: P must prove it holds it (Hello) before Register


class PrefillDirectory:
    """The prefill instances this D rank resolved and registered with, by bootstrap address."""

    def __init__(self, lock: Any, ctrl: ControlPlane, counters: Counters, env: DisaggEnv,
                 me: Pairing) -> None:
        self._lock, self._ctrl, self._counters, self._env, self._me = (
            lock, ctrl, counters, env, me)
        self._instances: dict[str, Instance] = {}
        self._addr_locks: dict[str, threading.Lock] = {}
        self._last_failure: dict[str, tuple[float, PDError]] = {}
        self._hellos: dict[str, threading.Event] = {}  # nonce -> set when P answered it
        self.client = BootstrapClient(token=me.token)
        self.register: wire.Register | None = None  # what D announces; set by start()

    # -- reads (under the lock the caller holds, or taking it) ---------------------------------
    def get(self, addr: str) -> Instance | None:
        with self._lock:
            return self._instances.get(addr)

    def instances(self) -> dict[str, Instance]:
        with self._lock:
            return dict(self._instances)

    def known(self) -> dict[str, str]:
        """address -> instance id: what the heartbeat probes."""
        with self._lock:
            return {a: i.instance_id for a, i in self._instances.items()}

    def __len__(self) -> int:
        with self._lock:
            return len(self._instances)

    # -- changes ---------------------------------------------------------------------------------
    def forget(self, addr: str, inst: Instance) -> None:
        """`inst` is gone (P dropped us, or the heartbeat lost it): the next room resolves and
        registers afresh; its ranks' connections close."""
        with self._lock:
            if self._instances.get(addr) is not inst:
                return
            del self._instances[addr]
        self.drop_connections(inst)

    def pop(self, addr: str) -> Instance | None:
        """Under the caller's lock: the instance at addr leaves the directory (a restart)."""
        return self._instances.pop(addr, None)

    def drop_connections(self, inst: Instance) -> None:
        for a in inst.ctrl_addrs.values():
            self._ctrl.drop(a)

    def resolve(self, addr: str, started: float) -> Instance:
        """The instance at addr, fetched and registered with if it is not known yet."""
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
        env, me = self._env, self._me
        budget = max(1.0, env.heartbeat_interval * env.heartbeat_max_failure)
        interval = min(1.0, budget / 5)
        attempts, deadline = int(budget / interval) + 1, time.monotonic() + budget
        info = self.client.get_info(addr, attempts, interval, deadline)
        version = info.protocol_version
        if version is not None and version != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"prefill {addr} speaks PD protocol version {version}, decode "
                                f"speaks {wire.PROTOCOL_VERSION}; run the same pdserve version")
        if info.backend and info.backend != me.backend_name:
            raise ProtocolError(f"prefill {addr} uses transfer backend {info.backend!r}, "
                                f"decode uses {me.backend_name!r}; give both the same "
                                "--disaggregation-transfer-backend (the default is mooncake "
                                "where pd-mooncake is installed, else tcp)")
        targets, required_dst, responses = rank_mapping(
            info.tp_size, me.tp_size, me.tp_rank, bool(info.is_mla))
        dp_size, inst_id = info.dp_size, info.instance_id
        ctrl: dict[tuple[int, int], str] = {}
        for dp in range(dp_size):
            for t in targets:  # every route from the instance the info came from, or none
                ip, port = self.client.get_rank(addr, dp, t, attempts, interval, deadline,
                                                 instance=inst_id)
                ctrl[(dp, t)] = f"tcp://{ip}:{port}"
        try:
            wire.check_pairing(f"prefill {addr}", info, me.kv, me.fingerprint, me.chain)
        except ProtocolError as e:
            self._counters.add("pairing_refused")
            raise PairingRefused(str(e), list(ctrl.values())) from None
        assert self.register is not None, "start() must run before add()"
        for a in ctrl.values():
            self._challenge(a, budget)
            if not self._ctrl.send(a, self.register):
                raise TransferError(f"cannot reach prefill rank at {a} to register")
        self._counters.add("registrations", len(ctrl))
        log.info("registered with prefill %s (instance %s, P DP %d x TP %s -> ranks %s)", addr,
                 info.instance_id, dp_size, info.tp_size, targets)
        return Instance(addr, inst_id, dp_size, info.tp_size,
                        targets, required_dst, responses, ctrl)

    def _challenge(self, addr: str, budget: float) -> None:
        """With a cluster secret, the prefill rank at addr must answer a fresh nonce with a
        MACed HelloAck before D sends it anything that reveals its memory (Register: the
        data-plane endpoint and KV addresses). Without one there is nothing to prove: the route
        itself was signed or trusted at D's HTTP edge."""
        if not self._me.token:
            return
        nonce, done = uuid.uuid4().hex, threading.Event()
        with self._lock:
            self._hellos[nonce] = done
        try:
            wait = min(max(1.0, budget), 10.0)
            if not self._ctrl.send(addr, wire.Hello(nonce=nonce, session=self._me.session,
                                                    ctrl_addr=self._ctrl.addr)) \
                    or not done.wait(wait):
                self._counters.add("pairing_refused")
                raise TransferError(
                    f"prefill rank at {addr} did not prove within {wait:g}s that it holds the "
                    "cluster secret (another --disaggregation-auth-token, or not a pdserve "
                    "prefill server); nothing was sent to it")
        finally:
            with self._lock:
                self._hellos.pop(nonce, None)

    def on_hello_ack(self, msg: wire.HelloAck) -> None:
        with self._lock:
            done = self._hellos.get(msg.nonce)
        if done is None:
            self._counters.add("stale_messages")
            return
        done.set()
