"""Pieces shared by the built-in `tcp` and `shm` transfer engines.

- `RegionIndex`: vectorised bounds checks and address translation over a set of MemoryRegions
  (one numpy pass per batch, never a Python loop per copy);
- `HandleTable`: integer handles over futures with the poll() contract (DONE/FAILED release)
  and a wait() that wakes on completion;
- `SharedExclusive`: a tiny shared/exclusive lock so memory is never unmapped or deregistered
  while a copy is still writing into it;
- `read_timeout`: the PDCORE_*_TIMEOUT style settings, validated.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as futures_wait

import numpy as np

from pdcore.errors import ConfigError
from pdcore.interfaces.transfer import (
    DONE,
    PENDING,
    MemoryRegion,
    PollResult,
    TransferStatus,
    failed,
)

# A single copy longer than this is refused outright: it keeps sums of up to 2**20 lengths far
# below 2**64, so no check in this module can be fooled by unsigned wrap-around.
MAX_ITEM_BYTES = 1 << 40


class RegionIndex:
    """Sorted regions with O(n log r) vectorised lookups."""

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        self.regions: tuple[MemoryRegion, ...] = tuple(sorted(regions, key=lambda r: r.addr))
        self.starts = np.array([r.addr for r in self.regions], dtype=np.uint64)
        self.ends = np.array([r.end for r in self.regions], dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.regions)

    def locate(self, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(region index per item, ok mask): ok where [addr, addr+length) lies in one region."""
        addr = np.asarray(addr, dtype=np.uint64)
        length = np.asarray(length, dtype=np.uint64)
        if not len(self.regions):
            return np.zeros(len(addr), dtype=np.int64), np.zeros(len(addr), dtype=bool)
        idx = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        end = self.ends[safe]
        # Written as `length <= end - addr` (after addr <= end) so nothing can wrap around.
        ok = (idx >= 0) & (addr <= end) & (length <= MAX_ITEM_BYTES)
        room = np.where(ok, end - np.where(ok, addr, end), 0)
        ok &= length <= room
        return safe, ok

    def first_bad(self, addr: np.ndarray, length: np.ndarray) -> int | None:
        """Index of the first item outside every region, or None when all are inside."""
        _, ok = self.locate(addr, length)
        if ok.all():
            return None
        return int(np.argmin(ok))


def describe_range(what: str, i: int, addr: np.ndarray, length: np.ndarray) -> str:
    return f"{what} item {i} [{int(addr[i]):#x}, +{int(length[i])} bytes)"


def region_views(regions: Sequence[MemoryRegion]) -> list[memoryview]:
    """Byte memoryviews over registered host memory (slicing one is cheaper than from_address)."""
    views = []
    for r in regions:
        if r.length == 0:
            views.append(memoryview(b""))
            continue
        arr = (ctypes.c_char * r.length).from_address(r.addr)
        views.append(memoryview(arr).cast("B"))
    return views


class HandleTable:
    """Handles for asynchronous jobs. poll() releases a handle once it reports DONE or FAILED."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._ids = itertools.count(1)
        self._jobs: dict[int, Future | PollResult] = {}
        self._lock = threading.Lock()

    def add(self, job: Future | PollResult) -> int:
        h = next(self._ids)
        with self._lock:
            self._jobs[h] = job
        return h

    def poll(self, handle: int) -> PollResult:
        with self._lock:
            job = self._jobs.get(handle)
            if job is None:
                return failed(
                    f"{self._owner}: unknown handle {handle} (never issued, or already reported "
                    f"done/failed by an earlier poll)"
                )
            if isinstance(job, PollResult):
                del self._jobs[handle]
                return job
            if not job.done():
                return PENDING
            del self._jobs[handle]
        try:
            result = job.result()
        except CancelledError:
            return failed(f"{self._owner}: transfer cancelled because the engine was closed")
        except Exception as e:  # noqa: BLE001 - a worker's failure becomes the handle's reason
            return failed(f"{self._owner}: {e}")
        return result if isinstance(result, PollResult) else DONE

    def wait(self, handle: int, timeout: float) -> PollResult:
        """poll() as soon as the handle's job has finished (woken by its completion, no polling
        delay), or FAILED 'timed out' after `timeout` seconds (the handle stays pending)."""
        with self._lock:
            job = self._jobs.get(handle)
        if isinstance(job, Future):
            futures_wait([job], timeout=max(0.0, timeout))
        r = self.poll(handle)
        if r.status is TransferStatus.PENDING:
            return failed(f"{self._owner}: timed out after {timeout:g}s")
        return r

    def pending_count(self) -> int:
        with self._lock:
            return len(self._jobs)


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


def read_timeout(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {raw!r}")
    return value
