"""Per-room poll states, shared by the prefill sender and the decode receiver.

Rules (both sides): a room exists only after the scheduler `create`s it; its state only moves
up (Bootstrapping < WaitingForInput < Transferring < Success) except Failed, which always wins
and is final; `remove` forgets it, and a late message for a removed room changes nothing (room
ids can be reused, so a stale Failed must never poison a later request).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = (KVPoll.Failed, KVPoll.Success)


@dataclass(slots=True)
class _Entry:
    state: KVPoll
    reason: str = ""
    since: float = 0.0  # monotonic time of the last state change


class RoomStates:
    """Thread-safe room -> (state, failure reason) table with the monotonic rule."""

    def __init__(self, listener: Callable[[int, KVPoll, bool], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[int, _Entry] = {}
        self._listener = listener  # (room, new state, created); Failed is not reported

    def create(self, room: int, state: KVPoll = KVPoll.Bootstrapping) -> None:
        with self._lock:
            self._rooms[room] = _Entry(state, "", time.monotonic())
            if self._listener is not None:
                self._listener(room, state, True)

    def exists(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms

    def get(self, room: int) -> KVPoll | None:
        with self._lock:
            e = self._rooms.get(room)
            return None if e is None else e.state

    def since(self, room: int) -> float | None:
        with self._lock:
            e = self._rooms.get(room)
            return None if e is None else e.since

    def advance(self, room: int, state: KVPoll) -> bool:
        """Move up to `state`; False when the room is unknown, failed, or already further."""
        with self._lock:
            e = self._rooms.get(room)
            if e is None or e.state is KVPoll.Failed or state <= e.state:
                return False
            e.state, e.since = state, time.monotonic()
            if self._listener is not None:
                self._listener(room, state, False)
            return True

    def fail(self, room: int, reason: str) -> bool:
        """Fail a known room; True if this call changed it (first failure wins the reason)."""
        with self._lock:
            e = self._rooms.get(room)
            if e is None or e.state is KVPoll.Failed:
                return False
            e.state, e.reason, e.since = KVPoll.Failed, reason, time.monotonic()
            return True

    def reason(self, room: int) -> str:
        with self._lock:
            e = self._rooms.get(room)
            return "" if e is None else e.reason

    def remove(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def snapshot(self) -> dict[int, KVPoll]:
        with self._lock:
            return {r: e.state for r, e in self._rooms.items()}

    def count(self, *states: KVPoll) -> int:
        with self._lock:
            return sum(1 for e in self._rooms.values() if not states or e.state in states)
