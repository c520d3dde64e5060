"""Handle table: the integer handles a backend's write() returns, and poll()/wait() over them.

A handle stands for one of:
- a PollResult: the write was settled at once (an empty batch, a refused one);
- a concurrent.futures.Future whose result is a PollResult, None (DONE) or a string (FAILED with
  that reason); an exception or a cancellation is FAILED too;
- any object with `poll() -> PollResult` (a transfer the backend's library tracks itself).
poll() releases a handle once it reports DONE or FAILED, and answers an unknown handle FAILED
with a reason naming it (the rule of pdcore.interfaces.transfer). wait() wakes as soon as a
future finishes; other jobs are polled.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as futures_wait
from typing import Any, Protocol

from pdcore.interfaces.transfer import (
    DONE,
    PENDING,
    PollResult,
    TransferStatus,
    failed,
    wait_by_polling,
)


class Pollable(Protocol):
    def poll(self) -> PollResult: ...


Job = Future | PollResult | Pollable


class HandleTable:
    """Integer handles over jobs, with the poll() contract of a TransferEngine.

    `owner` (the backend's name) prefixes the reasons the table writes itself.
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._ids = itertools.count(1)
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()

    def add(self, job: Job) -> int:
        h = next(self._ids)
        with self._lock:
            self._jobs[h] = job
        return h

    def poll(self, handle: int) -> PollResult:
        with self._lock:
            job = self._jobs.get(handle)
            if job is None:
                return failed(
                    f"{self._owner}: unknown handle {handle} (never issued by this engine, or "
                    f"already reported done/failed by an earlier poll)")
            if isinstance(job, Future):
                if not job.done():
                    return PENDING
                del self._jobs[handle]
            elif isinstance(job, PollResult):
                del self._jobs[handle]
                return job
        if not isinstance(job, Future):
            # the job's own poll may take the backend's lock, which write() holds while it adds
            # a handle here: never call it under this table's lock
            result = job.poll()
            if result.status is not TransferStatus.PENDING:
                with self._lock:
                    self._jobs.pop(handle, None)
            return result
        return self._outcome(job)

    def _outcome(self, job: Future) -> PollResult:
        try:
            result: Any = job.result()
        except CancelledError:
            return failed(f"{self._owner}: cancelled, the engine was closed before the transfer "
                          f"ran")
        except Exception as e:  # noqa: BLE001 - a worker's failure becomes the handle's reason
            return failed(f"{self._owner}: {type(e).__name__}: {e}")
        if isinstance(result, PollResult):
            return result
        return DONE if result is None else failed(str(result))

    def wait(self, handle: int, timeout: float) -> PollResult:
        """poll() as soon as the handle's job has finished (a future wakes this at once), or
        FAILED 'timed out' after `timeout` seconds (the handle stays pending)."""
        with self._lock:
            job = self._jobs.get(handle)
        if not isinstance(job, Future):
            return wait_by_polling(self.poll, handle, timeout)
        futures_wait([job], timeout=max(0.0, timeout))
        r = self.poll(handle)
        if r.status is TransferStatus.PENDING:
            return failed(f"{self._owner}: timed out after {timeout:g}s")
        return r

    def drain(self) -> list[Job]:
        """Forget every handle (a closing engine); returns their jobs so it can release them."""
        with self._lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        return jobs
