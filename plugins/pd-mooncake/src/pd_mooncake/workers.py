"""Transfer workers: the threads that carry Mooncake batches to completion.

1. `submit(key, job)` puts the job on queue crc32(key) % queue_size: one peer's jobs keep their
   order, different peers share the threads and the bandwidth (SGLANG_DISAGGREGATION_QUEUE_SIZE);
2. each queue is served by thread_pool_size // queue_size threads, at least one
   (SGLANG_DISAGGREGATION_THREAD_POOL_SIZE);
3. a job runs to its end on one thread: it returns None when done, else the failure reason;
4. `poll(handle)` answers PENDING / DONE / FAILED and forgets finished handles;
5. `close()` fails the jobs still queued and stops the threads (bounded join: a thread blocked
   inside the library on a frozen peer is a daemon and is left behind).

`InflightBudget` bounds the requests in flight to one peer across all threads: Mooncake's TCP
transport refuses more than its per-peer queue and then often cannot reach that peer again.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from pdcore.errors import TransferError
from pdcore.interfaces.transfer import DONE, PENDING, PollResult, TransferStatus, failed

log = logging.getLogger("pd_mooncake")

Job = Callable[[], "str | None"]
_STOP = object()


@dataclass(slots=True)
class _Task:
    job: Job
    done: threading.Event
    reason: str | None = None


class InflightBudget:
    """Counts requests in flight per peer; `acquire` waits (bounded) until there is room."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used: dict[str, int] = {}
        self._cond = threading.Condition()

    def acquire(self, key: str, n: int, timeout: float) -> bool:
        n = min(n, self.limit)
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._used.get(key, 0) + n > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._used[key] = self._used.get(key, 0) + n
            return True

    def release(self, key: str, n: int) -> None:
        n = min(n, self.limit)
        with self._cond:
            left = self._used.get(key, 0) - n
            if left > 0:
                self._used[key] = left
            else:
                self._used.pop(key, None)
            self._cond.notify_all()

    def in_flight(self, key: str) -> int:
        with self._cond:
            return self._used.get(key, 0)


class TransferWorkers:
    def __init__(self, thread_pool_size: int, queue_size: int, name: str = "pd-mooncake") -> None:
        self.queue_size = max(1, queue_size)
        self.threads_per_queue = max(1, thread_pool_size // self.queue_size)
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self.queue_size)]
        self._tasks: dict[int, _Task] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self.threads: list[threading.Thread] = []
        for qi, q in enumerate(self._queues):
            for wi in range(self.threads_per_queue):
                t = threading.Thread(target=self._serve, args=(q,), name=f"{name}-q{qi}-w{wi}",
                                     daemon=True)
                t.start()
                self.threads.append(t)

    def _serve(self, q: queue.SimpleQueue) -> None:
        while True:
            task = q.get()
            if task is _STOP:
                return
            if self._closed:
                task.reason = "transfer engine closed before the batch ran"
            else:
                try:
                    task.reason = task.job()
                except Exception as e:  # a job must never kill its worker thread
                    log.exception("transfer job raised")
                    task.reason = f"{type(e).__name__}: {e}"
            task.done.set()

    def _new(self, task: _Task) -> int:
        with self._lock:
            if self._closed:
                raise TransferError("transfer engine is closed; create a new one")
            handle = next(self._ids)
            self._tasks[handle] = task
            return handle

    def submit(self, key: str, job: Job) -> int:
        task = _Task(job, threading.Event())
        handle = self._new(task)
        self._queues[zlib.crc32(key.encode()) % self.queue_size].put(task)
        return handle

    def finished(self, reason: str | None = None) -> int:
        """A handle that is already DONE (reason None) or FAILED (e.g. an empty batch)."""
        task = _Task(lambda: None, threading.Event(), reason)
        task.done.set()
        return self._new(task)

    def poll(self, handle: int) -> PollResult:
        with self._lock:
            task = self._tasks.get(handle)
            if task is None:
                raise TransferError(f"unknown transfer handle {handle} (already finished or never issued)")
            if not task.done.is_set():
                return PENDING
            del self._tasks[handle]
        return DONE if task.reason is None else failed(task.reason)

    def wait(self, handle: int, timeout: float) -> PollResult:
        """poll() as soon as the task has finished (woken by it), or FAILED 'timed out' after
        `timeout` seconds (the handle stays pending)."""
        with self._lock:
            task = self._tasks.get(handle)
        if task is not None:
            task.done.wait(max(0.0, timeout))
        r = self.poll(handle)
        if r.status is TransferStatus.PENDING:
            return failed(f"mooncake: timed out after {timeout:g}s")
        return r

    def pending(self) -> int:
        with self._lock:
            return sum(1 for t in self._tasks.values() if not t.done.is_set())

    def close(self, join_timeout: float = 2.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for q in self._queues:
            for _ in range(self.threads_per_queue):
                q.put(_STOP)
        deadline = time.monotonic() + join_timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self.threads if t.is_alive()]
        if stuck:
            log.warning("transfer threads still blocked in mooncake after close: %s", ", ".join(stuck))
        with self._lock:
            self._tasks.clear()
