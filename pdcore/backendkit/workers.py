"""Sharded workers: FIFO queues chosen by key, each served by a fixed number of threads.

`submit(key, item)` puts the item on its key's queue, so one peer's (or one session's) work
keeps its order and a slow or dead peer stalls only its own queue while the others keep moving.
A key keeps its queue while it has work submitted and unfinished; a key with none gets the queue
that fewest such keys hold (ties: from crc32(key) % num_queues on). So two peers share a queue
only when more peers are busy than there are queues: a peer stuck in a transfer (a partition,
up to the transfer timeout) holds back no other peer while a queue is free, as a fixed hash of
the key did whenever two peers hashed alike (#49). num_threads // num_queues threads serve each
queue (at least one). A thread
runs `handler(item)` (default: calls the item) and settles the Future submit() returned; a
raising handler fails that future and is logged, never killing its thread. close() cancels what
never ran and hands it back, then joins the threads within a bound: a thread stuck inside a
library call on a frozen peer is a daemon and is left behind, with a warning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pdcore.errors import TransferError

log = logging.getLogger(__name__)

_STOP = object()


def _call(item: Callable[[], Any]) -> Any:
    return item()


class ShardedWorkers:
    def __init__(self, num_queues: int, num_threads: int,
                 handler: Callable[[Any], Any] = _call, label: str = "pd-xfer") -> None:
        self.num_queues = max(1, num_queues)
        self.threads_per_queue = max(1, num_threads // self.num_queues)
        self.label = label
        self._handler = handler
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(self.num_queues)]
        self.threads = [
            threading.Thread(target=self._run, args=(q,), name=f"{label}-q{i}-w{j}", daemon=True)
            for i, q in enumerate(self._queues) for j in range(self.threads_per_queue)
        ]
        self._lock = threading.Lock()
        self._closed = False
        self._unfinished = 0
        self._busy: dict[str, list[int]] = {}  # key -> [its queue, its unfinished items]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def shard(self, key: str) -> int:
        """The queue `key`'s next item goes to (call with the lock held)."""
        if (held := self._busy.get(key)) is not None:
            return held[0]
        keys = [0] * self.num_queues
        for q, _ in self._busy.values():
            keys[q] += 1
        first = zlib.crc32(key.encode()) % self.num_queues
        order = [(first + i) % self.num_queues for i in range(self.num_queues)]
        return min(order, key=keys.__getitem__)

    def submit(self, key: str, item: Any) -> Future:
        """Queue `item` behind the earlier items of its shard; TransferError once closed."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise TransferError(f"{self.label}: the transfer workers are closed; "
                                    f"create a new engine")
            self._unfinished += 1
            q = self.shard(key)
            self._busy.setdefault(key, [q, 0])[1] += 1
            self._queues[q].put((fut, key, item))
        return fut

    def pending(self) -> int:
        """Items queued that no thread has started yet."""
        return sum(q.qsize() for q in self._queues)

    def unfinished(self) -> int:
        """Items submitted and not finished yet (queued or running)."""
        with self._lock:
            return self._unfinished

    def _settled(self, key: str) -> None:
        with self._lock:
            self._unfinished -= 1
            held = self._busy.get(key)
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self._busy[key]

    def _run(self, q: queue.Queue) -> None:
        while True:
            entry = q.get()
            if entry is _STOP:
                return
            fut, key, item = entry
            if not fut.set_running_or_notify_cancel():
                continue  # close() cancelled it (and counted it settled)
            try:
                result = self._handler(item)
            except Exception as e:  # the future carries the failure; never lose the thread
                log.exception("%s: job %r raised", self.label, item)
                fut.set_exception(e)
            else:
                fut.set_result(result)
            finally:
                self._settled(key)

    def close(self, timeout: float | None = 5.0) -> list[Any]:
        """Stop the threads; returns the items that never ran (their futures are cancelled) so
        the caller can fail them. Joins for at most `timeout` seconds in all (None: until every
        thread is out, for a library that must not be torn down under a running call).
        Idempotent."""
        with self._lock:
            if self._closed:
                return []  # a second close(): the first one stopped everything
            self._closed = True
        leftovers: list[Any] = []
        for q in self._queues:
            while True:
                try:
                    fut, key, item = q.get_nowait()
                except queue.Empty:
                    break
                if fut.cancel():
                    self._settled(key)
                leftovers.append(item)
        for q in self._queues:
            for _ in range(self.threads_per_queue):
                q.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            if t.ident is not None:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self.threads if t.is_alive()]
        if stuck:
            log.warning("%s: threads still blocked in a transfer after close: %s", self.label,
                        ", ".join(stuck))
        return leftovers
