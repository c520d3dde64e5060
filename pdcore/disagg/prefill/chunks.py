"""Prefill's transfer workers (`ChunkWriter`, a part of PrefillKVManager): one queued chunk
written to every D rank of its room, then, after the room's last chunk, the aux row and
Status(Success).

- `run_chunk` (a sharded worker thread): plan the chunk per destination (`chunk_batch`:
  direct or through the staging ring), write it; a TransferError or a planner bug fails the
  room, never hangs it;
- `_chunk_done`: progress resets the room's deadline; the abort acks held while chunks were in
  flight go out; the last chunk of a room `_finish`es it;
- `_finish`: the aux row to each D rank (on the Status itself when the backend moves no data),
  then Status(Success); a draft head's chain start in the row counts its vector's bytes;
- `_write` / `_fail_session`: a failed write drops the D session at once and fails its rooms
  with SESSION_FAILED (D registers again on its next room).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcore.config import DisaggEnv
from pdcore.disagg import wire
from pdcore.disagg.aux import AuxBuffers
from pdcore.disagg.common import Counters
from pdcore.disagg.prefill.rooms import Chunk, Dest, RoomState
from pdcore.disagg.prefill.sessions import SessionTable
from pdcore.disagg.sessions import DecodeSession
from pdcore.disagg.staging import chunk_batch
from pdcore.disagg.states import TERMINAL, KVPoll, RoomStates
from pdcore.disagg.transfer_stats import TransferStats
from pdcore.errors import TransferError
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import CopyBatch

log = logging.getLogger("pdcore.disagg.prefill")


@dataclass(frozen=True)
class ChunkRoute:
    """What a chunk crosses by: the transfer backend, the planner and staging ring that shape
    its copies, P's KV layout and aux rows."""

    backend: Any
    planner: Any
    staging: Any
    kv: KVLayout
    aux: AuxBuffers


class ChunkWriter:
    """Writes P's queued chunks to the D ranks of their rooms (the transfer workers run
    `run_chunk`). It shares the manager's lock, rooms, sessions and counters; `fail` is the
    manager's (a room failed on both sides)."""

    def __init__(self, *, lock: Any, rooms: dict[int, RoomState], states: RoomStates,
                 sessions: SessionTable, route: ChunkRoute, counters: Counters,
                 xfer: TransferStats, env: DisaggEnv, ctrl: Any, tp_rank: int,
                 fail: Callable[..., None]) -> None:
        self._lock, self._rooms, self.states, self.sessions = lock, rooms, states, sessions
        self.backend, self.planner, self.staging = route.backend, route.planner, route.staging
        self.kv, self.aux = route.kv, route.aux
        self.counters, self.xfer, self.env = counters, xfer, env
        self.ctrl, self.tp_rank, self._fail = ctrl, tp_rank, fail

    def run_chunk(self, job: Chunk) -> None:
        ok = True
        try:
            with self._lock:
                r = self._rooms.get(job.room)
                dests = list(r.dests.values()) if r is not None else []
            if r is None or self.states.get(job.room) is KVPoll.Failed:
                ok = False
                return
            for d in dests:
                sess = self.sessions.get(d.session)
                if len(job.src_pages) == 0:
                    continue
                with chunk_batch(self.planner, self.staging, self.kv, sess, d, job.src_pages,
                                 page_start=job.page_start) as (batch, staged):
                    self._write(sess, batch, job.room)
                d.staged = d.staged or staged
                self.counters.add("bytes", batch.nbytes)
                self.xfer.add_bytes(job.room, batch.nbytes)
                self.counters.add("staged_bytes" if staged else "direct_bytes", batch.nbytes)
            self.counters.add("chunks")
        except TransferError as e:
            ok = False
            self._fail(job.room, str(e))
        except Exception as e:  # a planner bug must fail the room, not hang it
            ok = False
            log.exception("room %d: chunk transfer raised", job.room)
            self._fail(job.room, f"chunk transfer raised {type(e).__name__}: {e}")
        finally:
            self._chunk_done(job, ok)

    def _chunk_done(self, job: Chunk, ok: bool) -> None:
        with self._lock:
            r = self._rooms.get(job.room)
            if r is None:
                return
            r.inflight -= 1
            r.deadline = time.monotonic() + self.env.waiting_timeout  # progress
            acks = r.abort_acks if r.inflight == 0 else []
            if acks:
                r.abort_acks = []
            final = ok and r.last_queued and r.inflight == 0
            dests = list(r.dests.values())
            aux_slot = r.final_aux
        for addr in acks:
            self.ctrl.send(addr, wire.AbortAck(room=job.room, rank=self.tp_rank))
        if final and self.states.get(job.room) is not KVPoll.Failed:
            self._finish(job.room, dests, aux_slot)

    def _finish(self, room: int, dests: list[Dest], aux_slot: int | None) -> None:
        """All chunks landed: copy the aux row to each D rank, then report Success."""
        moves = self.backend.capabilities.moves_data
        try:
            payloads: dict[str, bytes] = {}
            for d in dests:
                payloads[d.session] = b""
                if aux_slot is None or d.aux_slot == wire.NO_AUX_SLOT:
                    continue
                if not moves:  # the backend moves nothing: the row rides on the Status
                    payloads[d.session] = self.aux.raw(aux_slot)
                else:
                    sess = self.sessions.get(d.session)
                    n = np.array([self.aux.row_bytes], dtype=np.uint64)
                    batch = CopyBatch(np.array([self.aux.slot_addr(aux_slot)], dtype=np.uint64),
                                      np.array([sess.aux_addr(d.aux_slot)], dtype=np.uint64), n)
                    self._write(sess, batch, room)
                self._count_chain(room)
        except TransferError as e:
            self._fail(room, str(e))
            return
        if self.states.get(room) is KVPoll.Failed:  # aborted meanwhile
            return
        for d in dests:
            sent = self.ctrl.send(d.ctrl_addr, wire.Status(
                room=room, state=int(KVPoll.Success), rank=self.tp_rank, aux=payloads[d.session],
                staged=d.staged))
            if not sent:
                self._fail(room, f"cannot reach decode rank {d.rank} at {d.ctrl_addr}", "",
                           notify=False)
                return
        if self.states.advance(room, KVPoll.Success):
            self.counters.add("transfers")
            log.debug("room %d: transferred", room)

    def _count_chain(self, room: int) -> None:
        """A draft head's chain start crossed with the aux row (its vector's bytes count as
        transferred; rows without one move what they always did, uncounted)."""
        n = self.aux.chain_bytes
        if n:
            self.counters.add("bytes", n)
            self.counters.add("chain_start_bytes", n)
            self.xfer.add_bytes(room, n)

    def _write(self, sess: DecodeSession, batch: CopyBatch, room: int) -> None:
        try:
            sess.write(self.backend, batch, self.env.waiting_timeout)
        except TransferError as e:
            self._fail_session(sess, str(e))
            raise TransferError(f"transfer to decode session {sess.key} failed: {e}",
                                room) from None

    def _fail_session(self, sess: DecodeSession, why: str) -> None:
        """Drop a D session at once and fail its unfinished rooms with SESSION_FAILED: D then
        forgets this P and registers again on its next room (a frozen D is back at once)."""
        self.sessions.drop(sess, why)
        with self._lock:
            rooms = [room for room, r in self._rooms.items() if sess.key in r.dests]
        self.counters.add("session_failures")
        log.warning("decode session %s dropped: %s", sess.key, why)
        for room in rooms:
            if self.states.get(room) not in TERMINAL:
                self._fail(room, f"transfer to decode session {sess.key} failed: {why} "
                                 f"(decode could be dead)", wire.SESSION_FAILED)
