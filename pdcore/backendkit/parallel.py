"""One batch over several copy workers: `split_by_bytes` cuts its items into ranges of about
equal bytes (one per worker, big batches only), `join_futures` makes the ranges' futures one
future (DONE when every range is, else the first failure)."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

import numpy as np

from pdcore.interfaces.transfer import DONE, PollResult


def split_by_bytes(length: np.ndarray, workers: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Item ranges [a, b) of roughly equal bytes: at most `workers`, none much under
    `chunk_bytes` (a small batch is one range)."""
    total = int(length.sum())
    parts = min(workers, max(1, total // chunk_bytes), len(length))
    if parts <= 1:
        return [(0, len(length))]
    cuts = np.searchsorted(np.cumsum(length, dtype=np.uint64),
                           np.arange(1, parts, dtype=np.uint64) * (total // parts))
    bounds = [0, *sorted({int(c) + 1 for c in cuts if 0 <= c < len(length) - 1}), len(length)]
    return list(itertools.pairwise(bounds))


def join_futures(futures: list[Future], cancelled: PollResult) -> Future:
    """One future for the ranges of a batch: DONE when all are; else the first range's failure
    (its exception, its non-DONE result, or `cancelled` for a range that never ran)."""
    joined: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def range_done(_f: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        for f in futures:
            if f.cancelled():
                joined.set_result(cancelled)
                return
            if f.exception() is not None:
                joined.set_exception(f.exception())
                return
            if f.result().status is not DONE.status:
                joined.set_result(f.result())
                return
        joined.set_result(DONE)

    for f in futures:
        f.add_done_callback(range_done)
    return joined
