"""P's transfer workers: FIFO queues sharded by decode session, a fixed number of threads.

`SGLANG_DISAGGREGATION_QUEUE_SIZE` queues share `SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`
threads (pool // queues each, at least one). All work for one decode session lands in the same
queue, so a dead or slow decode stalls only its shard while the other sessions keep moving.
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class ShardedWorkers:
    def __init__(self, num_queues: int, num_threads: int, handler: Callable[[Any], None],
                 label: str = "pd-xfer") -> None:
        self.num_queues = max(1, num_queues)
        per_queue = max(1, num_threads // self.num_queues)
        self._handler = handler
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(self.num_queues)]
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"{label}-{i}-{j}", daemon=True)
            for i, q in enumerate(self._queues) for j in range(per_queue)
        ]
        self._closed = False

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def shard(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.num_queues

    def submit(self, key: str, job: Any) -> None:
        if self._closed:
            raise RuntimeError("transfer workers are closed")
        self._queues[self.shard(key)].put(job)

    def pending(self) -> int:
        return sum(q.qsize() for q in self._queues)

    def _run(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            if job is _STOP:
                return
            try:
                self._handler(job)
            except Exception:  # the handler fails its room itself; never lose the thread
                log.exception("transfer worker: job %r raised", job)

    def close(self, timeout: float = 5.0) -> list[Any]:
        """Stop the threads; returns the jobs that never ran (so the caller can fail them)."""
        self._closed = True
        leftovers: list[Any] = []
        for q in self._queues:
            while True:
                try:
                    job = q.get_nowait()
                except queue.Empty:
                    break
                leftovers.append(job)
        per_queue = len(self._threads) // self.num_queues
        for q in self._queues:
            for _ in range(per_queue):
                q.put(_STOP)
        for t in self._threads:
            if t.ident is not None:
                t.join(timeout=timeout)
        return leftovers
