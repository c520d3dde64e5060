"""A TransferEngine base whose poll() and wait() answer from a HandleTable."""

from __future__ import annotations

import threading

from pdcore.backendkit.handles import HandleTable
from pdcore.errors import TransferError
from pdcore.interfaces.transfer import PollResult, TransferEngine


class HandleEngine(TransferEngine):
    """poll() and wait() of `self.handles` (set it in __init__, or make it a property), so the
    unknown-handle rule and the wake-on-completion wait come with it; `_check_open()` refuses
    work once `self._closed` is set, and `_mark_closed()` sets it once, under `self._lock`."""

    handles: HandleTable
    _closed: bool = False
    _lock: threading.Lock

    def poll(self, handle: int) -> PollResult:
        return self.handles.poll(handle)

    def wait(self, handle: int, timeout: float = 30.0) -> PollResult:
        return self.handles.wait(handle, timeout)  # wakes when a job's future finishes

    def _mark_closed(self) -> bool:
        """Set `_closed` under `_lock`; False when it was already set (a second close())."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name}: engine is closed; create a new one")
