"""Region index: which registered region holds each address of a batch, vectorised.

One numpy pass per batch (never a Python loop per copy): a backend checks that every copy lies
inside registered memory, translates addresses to a region's own base, or looks up a property
of the region each address falls in. The protocol uses the same index to refuse a planned copy
outside what the peer registered.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from pdcore.interfaces.transfer import CopyBatch, MemoryRegion

# A single copy longer than this is refused outright: it keeps sums of up to 2**20 lengths far
# below 2**64, so no check over these arrays can be fooled by unsigned wrap-around.
MAX_ITEM_BYTES = 1 << 40


class RegionIndex:
    """Regions sorted by address, with O(n log r) lookups over arrays of addresses."""

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        self.regions: tuple[MemoryRegion, ...] = tuple(sorted(regions, key=lambda r: r.addr))
        self.starts = np.array([r.addr for r in self.regions], dtype=np.uint64)
        self.ends = np.array([r.end for r in self.regions], dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.regions)

    def position(self, addr: np.ndarray) -> np.ndarray:
        """Per address, the index of the last region starting at or below it (0 when none
        does): the region it lies in, if any. Needs at least one region."""
        idx = np.searchsorted(self.starts, np.asarray(addr, dtype=np.uint64), side="right")
        return np.maximum(idx.astype(np.int64) - 1, 0)

    def locate(self, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(region index per item, ok mask): ok where [addr, addr+length) lies in one region."""
        addr = np.asarray(addr, dtype=np.uint64)
        length = np.asarray(length, dtype=np.uint64)
        if not len(self.regions):
            return np.zeros(len(addr), dtype=np.int64), np.zeros(len(addr), dtype=bool)
        idx = self.position(addr)
        end = self.ends[idx]
        # Written as `length <= end - addr` (after start <= addr <= end) so nothing can wrap.
        ok = (self.starts[idx] <= addr) & (addr <= end) & (length <= MAX_ITEM_BYTES)
        room = np.where(ok, end - np.where(ok, addr, end), 0)
        ok &= length <= room
        return idx, ok

    def outside(self, what: str, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, str]:
        """(region index per item, '') when every item lies inside one region, else the first
        item that does not, in words ("src item 3 [0x..., +4096 bytes)") for a reason."""
        idx, ok = self.locate(addr, length)
        if ok.all():
            return idx, ""
        return idx, describe_range(what, int(np.argmin(ok)), addr, length)

    def contains(self, addr: np.ndarray, length: np.ndarray) -> bool:
        """Whether every [addr, addr+length) lies inside one region (True for no items)."""
        return bool(self.locate(addr, length)[1].all())


def describe_range(what: str, i: int, addr: np.ndarray, length: np.ndarray) -> str:
    """Item i of a batch in words, for a failure reason."""
    return f"{what} item {i} [{int(addr[i]):#x}, +{int(length[i])} bytes)"


def batch_arrays(batch: CopyBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's src, dst and length as contiguous uint64 arrays (what the lookups take)."""
    return tuple(np.ascontiguousarray(a, dtype=np.uint64)  # type: ignore[return-value]
                 for a in (batch.src, batch.dst, batch.length))


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
