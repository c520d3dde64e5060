"""What both KV managers are, whatever their role: a table of rooms with poll states, a transfer
backend holding this rank's KV and aux regions, a control plane to the other role's ranks, and
counters. The scheduler-facing calls that do not depend on the role (poll, failure_reason,
is_fake, peer_fault, release, metrics, close) and the failure path live here once;
PrefillKVManager and DecodeKVManager add only what the protocol makes differ (see their module
docstrings).

Every room record a subclass keeps in `_rooms` has `fake` and `deadline` (None: no timeout
running); `_fail` is the one way a room fails: the first cause wins, it is counted and logged,
and the peer's ranks of the room are told unless the news came from them.
"""

from __future__ import annotations

import logging
import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.disagg import wire
from pdcore.disagg.aux import AuxBuffers
from pdcore.disagg.common import Counters, make_backend, make_planner
from pdcore.disagg.control import ControlPlane
from pdcore.disagg.staging import open_staging
from pdcore.disagg.states import TERMINAL, KVPoll, RoomStates
from pdcore.disagg.transfer_stats import TransferStats
from pdcore.engine.model.fingerprint import model_fingerprint
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import MemoryRegion

_LIVE = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)


class KVManager(ABC):
    role = ""  # "prefill" or "decode": names this side in logs, reasons and thread names
    peer_fault_codes: frozenset[str] = frozenset()  # failure codes that blame the peer role

    def __init__(self, args: ServerArgs, env: DisaggEnv, kv: KVLayout,
                 kv_regions: Sequence[MemoryRegion], aux: AuxBuffers, backend_name: str,
                 *, tp_rank: int = 0, tp_size: int = 1, kv_tensors: Sequence[Any] | None = None,
                 pool: Any = None) -> None:
        self.args, self.env, self.kv, self.aux = args, env, kv, aux
        self.backend_name, self.tp_rank, self.tp_size = backend_name, tp_rank, tp_size
        self.kv_regions = list(kv_regions)
        self.token = args.disaggregation_auth_token or None
        self.fingerprint = model_fingerprint(args.model_path, args.load_format, args.random_seed)
        self._log = logging.getLogger(type(self).__module__)
        self.planner = make_planner(env)
        staging = open_staging(self.planner, self.role, kv, kv_tensors, pool, env)
        self.backend = make_backend(backend_name, self.role, args, env, tp_rank, tp_size)
        self.backend.register(self.kv_regions + [aux.region] + self._adopt_staging(staging))
        self.xfer = TransferStats(backend_name)
        self.states = RoomStates(self.xfer.on_state)
        self.counters = Counters()
        self._lock = threading.RLock()
        self._closed = False
        self._rooms: dict[int, Any] = {}
        self._peer_faults: set[int] = set()  # failed rooms whose cause is the peer role
        # failed rooms whose request is at fault (409) -> the wire code saying how
        self._client_faults: dict[int, str] = {}
        self._refused_routes: set[int] = set()  # failed rooms whose route decode refused (403)
        self._restart_faults: set[int] = set()  # peer faults: the peer instance restarted
        self._handlers: Mapping[type, Callable[[Any], None]] = {}  # message type -> handler
        self.ctrl = ControlPlane(args.host, self.token, f"{self.role}{tp_rank}", self._on_message,
                                 self._on_tick, on_foreign=self._on_foreign)
        self._setup()

    # -- scheduler API shared by both roles ---------------------------------------------------
    def poll(self, room: int) -> KVPoll:
        state = self.states.get(room)
        if state is None:
            return KVPoll.Failed
        if (self.env.test_failure_prob > 0 and state not in TERMINAL
                and random.random() < self.env.test_failure_prob):
            self._fail(room, "injected failure (DISAGGREGATION_TEST_FAILURE_PROB)")
            return KVPoll.Failed
        return state

    def failure_reason(self, room: int) -> str:
        if not self.states.exists(room):
            return f"room {room} is not known to this {self.role} KV manager"
        return self.states.reason(room)

    def is_fake(self, room: int) -> bool:
        with self._lock:
            r = self._rooms.get(room)
            return bool(r and r.fake)

    def peer_fault(self, room: int) -> bool:
        """True when `room` failed because of the peer role (the router blames that role)."""
        with self._lock:
            return room in self._peer_faults

    def restart_fault(self, room: int) -> bool:
        """True when `room` failed because its peer instance restarted (nobody to blame)."""
        with self._lock:
            return room in self._restart_faults

    def client_fault(self, room: int) -> bool:
        """True when `room` failed because of its request (a copied route, another prompt)."""
        with self._lock:
            return room in self._client_faults

    def client_fault_code(self, room: int) -> str:
        """The wire code of a client fault (ROOM_CLAIMED, PROMPT_MISMATCH), else ""."""
        with self._lock:
            return self._client_faults.get(room, "")

    def route_refused(self, room: int) -> bool:
        """True when `room` failed because decode refused its route (route_refusal.py)."""
        with self._lock:
            return room in self._refused_routes

    def release(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
            self._peer_faults.discard(room)
            self._restart_faults.discard(room)
            self._client_faults.pop(room, None)
            self._refused_routes.discard(room)
            self.states.remove(room)
        self.xfer.forget(room)

    def metrics(self) -> dict:
        out = self.counters.snapshot()
        out.update(self.ctrl.counters.snapshot())
        out["inflight_rooms"] = self.states.count(*_LIVE)
        out.update(self._role_metrics())
        return out

    def transfer_stats(self) -> dict:
        """Per-room transfer measurements (see transfer_stats) and live rooms per state."""
        snap = self.xfer.snapshot()
        snap["rooms"] = {s.name: self.states.count(s) for s in _LIVE}
        return snap

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:  # tell the peer now rather than letting its rooms run into timeouts
            rooms = [r for r in self._rooms if self.states.get(r) not in TERMINAL]
        for room in rooms:
            self._fail(room, f"{self.role} server is shutting down")
        self._shutdown()

    # -- what each role adds -------------------------------------------------------------------
    @abstractmethod
    def _adopt_staging(self, staging: Any) -> list[MemoryRegion]:
        """Keep this role's staging memory (None: none); returns its regions to register."""

    @abstractmethod
    def _setup(self) -> None:
        """This role's own state, threads (not started) and message handlers."""

    @abstractmethod
    def _role_metrics(self) -> dict:
        """This role's own gauges for metrics()."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop this role's threads, control plane and backend (rooms are failed already)."""

    @abstractmethod
    def _notify_failed(self, r: Any, reason: str, code: str) -> None:
        """Tell the peer's ranks of room record `r` that it failed here."""

    @abstractmethod
    def _on_tick(self) -> None:
        """Timeouts and deferred work, on the control-plane thread."""

    def holds(self, room: int) -> bool:
        """A request holds `room` here (live, or ended and not released yet)."""
        with self._lock:
            return room in self._rooms

    # -- shared machinery ----------------------------------------------------------------------
    def _claim(self, room: int) -> bool:
        """Under the lock: False when a room with this number is still held by a request, live
        or already ended but not released (both fail; a record is never shared or replaced)."""
        if room in self._rooms:
            self._fail(room, f"bootstrap room {room} is already in use by another request "
                             f"on this {self.role} server; use a unique bootstrap_room")
            return False
        return True

    def _fail(self, room: int, reason: str, code: str = "", notify: bool = True) -> None:
        if not self.states.fail(room, reason):
            return
        if code in self.peer_fault_codes:  # set.add is atomic; release() discards under the lock
            self._peer_faults.add(room)
        if code == wire.PREFILL_RESTARTED:
            self._restart_faults.add(room)
        if code in wire.CLIENT_FAULTS:
            self._client_faults[room] = code
        if code == wire.ROUTE_REFUSED:
            self._refused_routes.add(room)
        self.counters.add("failures")
        self.xfer.failed(room, code, reason)
        self._log.warning("room %d: failed: %s", room, reason)
        if not notify:
            return
        with self._lock:
            r = self._rooms.get(room)
        if r is not None:
            self._notify_failed(r, reason, code)

    def _expired(self, now: float, why: Mapping[KVPoll, str]) -> list[tuple[int, str]]:
        """(room, why[state]) for every room past its deadline in one of the states of `why`."""
        with self._lock:
            return [(room, why[state]) for room, r in self._rooms.items()
                    if r.deadline is not None and now > r.deadline
                    and (state := self.states.get(room)) in why]

    def _on_foreign(self, err: wire.VersionMismatch) -> None:
        """An authentic message of another protocol version (a peer running another pdserve):
        the room it names fails with the reason (the client sees it), and a request of the
        peer's (it names where to answer) gets a Status(Failed) in the peer's own version."""
        self.counters.add("version_refusals")
        if err.room >= 0:
            self._refuse_room(err.room, str(err))
        if err.kind in ("register", "claim", "transfer_info", "abort") and err.ctrl_addr:
            data = wire.refusal(err, self.tp_rank, self.token)
            if data is not None:
                self.ctrl.send_raw(err.ctrl_addr, data, "refusal")

    def _refuse_room(self, room: int, why: str) -> None:
        """A foreign-version message named this room: fail it (the peer cannot be told)."""
        self._fail(room, why, wire.VERSION_MISMATCH, notify=False)

    def _on_message(self, msg: wire.Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._log.warning("%s: unexpected %s message dropped", self.role, type(msg).__name__)
            return
        handler(msg)
