"""Transfer workers and the per-peer in-flight budget of the mooncake backend.

`TransferWorkers` is the backend kit's TransferJobs (pdcore.backendkit) named for Mooncake:
1. `submit(key, job)` puts the job on its peer's queue: one peer's jobs keep their order, and
   a peer with jobs in flight shares its queue with no other busy peer while a queue is free
   (pdcore.backendkit.workers), so a peer frozen mid-transfer holds back only itself; different
   peers share the threads and the bandwidth (SGLANG_DISAGGREGATION_QUEUE_SIZE);
2. each queue is served by thread_pool_size // queue_size threads, at least one
   (SGLANG_DISAGGREGATION_THREAD_POOL_SIZE);
3. a job runs to its end on one thread: it returns None when done, else the failure reason;
4. `poll(handle)` answers PENDING / DONE / FAILED and forgets finished handles (an unknown one
   is FAILED, as the transfer contract says);
5. `close()` cancels the jobs still queued and stops the threads (bounded join: a thread blocked
   inside the library on a frozen peer is a daemon and is left behind).

`InflightBudget` bounds the requests in flight to one peer across all threads: Mooncake's TCP
transport refuses more than its per-peer queue and then often cannot reach that peer again.
"""

from __future__ import annotations

import threading
import time

from pdcore.backendkit import TransferJobs


class TransferWorkers(TransferJobs):
    def __init__(self, thread_pool_size: int, queue_size: int, name: str = "pd-mooncake") -> None:
        super().__init__("mooncake", thread_pool_size, queue_size, label=name)


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
