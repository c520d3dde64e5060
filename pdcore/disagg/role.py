"""What the prefill and decode scheduling extensions share: the scheduler API they act through,
their KV manager and aux rows, the agreed poll over their rooms, the release of a room, the
requests an error names, and the common part of their metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcore.disagg.agree import Agreed, poll_all
from pdcore.disagg.aux import AuxBuffers
from pdcore.disagg.states import TERMINAL, KVPoll
from pdcore.engine.sched.api import SchedulerAPI
from pdcore.engine.sched.extension import Extension
from pdcore.engine.sched.request import Req
from pdcore.engine.sched.scheduler import Scheduler
from pdcore.engine.sched.stats import Kind, StatsReport
from pdcore.messages.codes import ErrorCode

# the KV manager's metrics() are running totals except these amounts (exported as kv_<name>)
KV_MANAGER_LOADS = frozenset({
    "inflight_rooms", "sessions", "queued_chunks", "prefill_instances", "pending_rooms",
    "staging_waiting_rooms", "staging_quarantined", "staging_ring_bytes",
    "staging_ring_used_bytes"})


class RoleExtension(Extension):
    """Base of PrefillExtension and DecodeExtension; `req.disagg` holds a state with `room`
    and `aux_slot` while the protocol runs for the request."""

    def __init__(self, sched: Scheduler, mgr: Any, aux: AuxBuffers, counts: list[str]) -> None:
        self.sched, self.mgr, self.aux = SchedulerAPI(sched), mgr, aux
        self.counts = dict.fromkeys(counts, 0)

    def _take(self, req: Req, state: Any) -> None:
        """Admit `req` into the protocol: the extension holds it under `state`."""
        req.disagg = state
        self.sched.hold(req)

    def _duplicate(self, req: Req, room: int) -> bool:
        """True (the request failed with 409) when `room` is held by another request here: the
        newcomer is refused and the room it names goes on untouched (a client repeating
        another's room cannot fail it)."""
        holds = getattr(self.mgr, "holds", None)  # stand-in managers in unit tests have none
        if holds is None or not holds(room):
            return False
        self.sched.fail(req, f"bootstrap room {room} is already in use by another request on "
                             f"this {self.mgr.role} server; use a unique bootstrap_room", 409)
        return True

    def _agree(self, reqs: list[Req], **kw: Any) -> Agreed:
        """Poll states (and counts) of these requests' rooms, agreed by every TP rank."""
        return poll_all(self.mgr, [r.disagg.room for r in reqs], self.sched.tp_group, **kw)

    def _admit_ready(self, agreed: Agreed, queue: list[Req],
                     ready: Callable[[Req], bool]) -> None:
        """Walk a FIFO queue of requests waiting for their peer: a Failed room fails its
        request; one whose peer is ready (WaitingForInput or later) is offered to `ready`,
        which moves it on or returns False when it must wait (and the rest behind it)."""
        for req in list(queue):
            st = agreed.state(req.disagg.room)
            if st is KVPoll.Failed:
                queue.remove(req)
                self._fail(req, agreed.reasons.get(req.disagg.room, ""))
            elif st >= KVPoll.WaitingForInput and not ready(req):
                break

    def _settle(self, agreed: Agreed, queue: list[Req], done: Callable[[Req], None]) -> None:
        """Requests whose transfer ran: Success goes to `done`, Failed fails the request."""
        for req in list(queue):
            st = agreed.state(req.disagg.room)
            if st is KVPoll.Success:
                queue.remove(req)
                done(req)
            elif st is KVPoll.Failed:
                queue.remove(req)
                self._fail(req, agreed.reasons.get(req.disagg.room, ""))

    def _fail(self, req: Req, reason: str) -> None:
        self.sched.fail(req, reason)

    def _fail_status(self, room: int) -> int:
        """409 when the room failed because of its request (a copied route, another prompt);
        403 when decode refused its route (as decode answered); 502 when the peer role failed
        it (the router blames that role), else 500."""
        client = getattr(self.mgr, "client_fault", None)
        if client is not None and client(room):
            return 409
        refused = getattr(self.mgr, "route_refused", None)
        if refused is not None and refused(room):
            return 403
        return 502 if self.mgr.peer_fault(room) else 500

    def _fail_code(self, room: int, status: int) -> ErrorCode | None:
        """The named reason of a `_fail_status` answer, the error body's code a router acts on:
        a refused route; the peer's fault, or its restart (the instance there now is new)."""
        if status == 403:
            return ErrorCode.ROUTE_REFUSED
        if status == 409:  # the wire's client-fault codes are the error codes' values
            how = getattr(self.mgr, "client_fault_code", None)
            code = how(room) if how is not None else ""
            return ErrorCode(code) if code in ErrorCode._value2member_map_ else None
        if status != 502:
            return None
        restarted = getattr(self.mgr, "restart_fault", None)
        return ErrorCode.PEER_RESTARTED if restarted is not None and restarted(room) else \
            ErrorCode.PEER_FAILED

    def _end_room(self, req: Req) -> None:
        """The request ends before its room did: abort the room (tells the peer), release it."""
        if self.mgr.poll(req.disagg.room) not in TERMINAL:
            self.mgr.abort(req.disagg.room, req.error or "request aborted")
        self._release(req)

    def _release(self, req: Req) -> None:
        st = req.disagg
        self.mgr.release(st.room)
        if st.aux_slot is not None:
            self.aux.free(st.aux_slot)
            st.aux_slot = None

    def implicated(self, error: Exception) -> list[Req]:
        room = getattr(error, "room", None)
        if room is None:
            return []
        return [r for r in self.sched.live() if getattr(r.disagg, "room", None) == room]

    def _stats(self, queues: dict[str, Any]) -> StatsReport:
        c = self.counts
        transfer = getattr(self.mgr, "transfer_stats", None)  # stand-in managers have none
        r = StatsReport().add(Kind.LOAD, queues)
        r.add(Kind.TOTAL, {f"disagg_{k}_total": v for k, v in c.items()})
        r.add(Kind.INFO, {"disagg_transfers_per_request": c["transfers"] / max(1, c["requests"])})
        r.add(Kind.LOAD, {"aux_slots_free": self.aux.num_free})
        r.kv_transfer = transfer() if transfer else {}
        for k, v in self.mgr.metrics().items():
            if isinstance(v, (int, float)):
                r.add(Kind.LOAD if k in KV_MANAGER_LOADS else Kind.TOTAL, {f"kv_{k}": v})
        return r

    def close(self) -> None:
        self.mgr.close()



