"""A shared/exclusive lock, so memory is never unmapped or deregistered while a copy still
reads from or writes into it."""

from __future__ import annotations

import threading


class SharedExclusive:
    """Many holders of the shared side at once, or one exclusive holder. A waiting exclusive
    request blocks new shared holders (so deregistering memory cannot be starved, and work
    queued behind it sees the change). Waits are bounded by their timeouts."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive requests not yet granted

    def acquire_shared(self, timeout: float | None = None) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._exclusive and not self._waiting,
                                       timeout):
                return False
            self._shared += 1
            return True

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            self._cond.notify_all()

    def acquire_exclusive(self, timeout: float | None = None) -> bool:
        with self._cond:
            self._waiting += 1
            try:
                ok = self._cond.wait_for(lambda: not self._exclusive and self._shared == 0,
                                         timeout)
            finally:
                self._waiting -= 1
                if not self._waiting:
                    self._cond.notify_all()
            if ok:
                self._exclusive = True
            return ok

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()
