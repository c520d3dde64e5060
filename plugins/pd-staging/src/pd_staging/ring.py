"""Decode side: the staging ring pool and the scatter of a finished grant into the KV pages.

1. `DecodeRing` allocates one byte buffer of SGLANG_DISAGG_STAGING_POOL_SIZE_MB from the KV
   memory pool (so the transfer backend can write into it) and hands out grants with a
   next-fit ring allocator: grants are carved from a cursor that moves forward and wraps, so
   consecutive rooms take consecutive space and freed space behind the cursor is reused last;
2. a full ring answers None (the core keeps the room waiting, FIFO); freeing coalesces;
3. `scatter` copies each writer's page-major block into its heads of the room's pages
   (pd_staging.copies); scatters of different rooms may run concurrently (disjoint pages).
"""

from __future__ import annotations

import bisect
import threading

import numpy as np
import torch

from pd_staging.copies import scatter
from pd_staging.geometry import grant_geometry
from pdcore.interfaces.planner import DecodeStaging, StagingContext
from pdcore.interfaces.transfer import MemoryRegion

ALIGN = 64  # grants start on 64-byte boundaries (RDMA-friendly, element aligned)


class RingAllocator:
    """Next-fit allocator over [0, size) with a wrapping cursor; thread-safe."""

    def __init__(self, size: int, align: int = ALIGN) -> None:
        self.size, self.align = size, align
        self._starts: list[int] = [0]  # free blocks, sorted by start
        self._ends: list[int] = [size]
        self._used: dict[int, int] = {}
        self._cursor = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def alloc(self, n: int) -> int | None:
        n = -(-max(1, n) // self.align) * self.align
        with self._lock:
            k = len(self._starts)
            first = bisect.bisect_right(self._starts, self._cursor) - 1
            if first < 0 or self._ends[first] <= self._cursor:
                first += 1  # the cursor sits in used space: start at the next free block
            for i in [(first + j) % k for j in range(k)]:
                start, end = self._starts[i], self._ends[i]
                if start <= self._cursor < end and end - self._cursor >= n:
                    start = self._cursor  # continue right where the last grant ended
                elif end - start < n:
                    continue
                self._carve(i, start, start + n)
                self._used[start] = n
                self._cursor = (start + n) % self.size
                return start
            return None

    def _carve(self, i: int, lo: int, hi: int) -> None:
        start, end = self._starts[i], self._ends[i]
        del self._starts[i], self._ends[i]
        for a, b in ((start, lo), (hi, end)):
            if b > a:
                j = bisect.bisect_left(self._starts, a)
                self._starts.insert(j, a)
                self._ends.insert(j, b)

    def free(self, offset: int) -> None:
        with self._lock:
            n = self._used.pop(offset, None)
            if n is None:
                raise ValueError(f"staging ring: offset {offset} is not an allocated grant")
            lo, hi = offset, offset + n
            j = bisect.bisect_left(self._starts, lo)
            if j < len(self._starts) and self._starts[j] == hi:  # merge with the next block
                hi = self._ends[j]
                del self._starts[j], self._ends[j]
            if j > 0 and self._ends[j - 1] == lo:  # and with the previous one
                self._ends[j - 1] = hi
            else:
                self._starts.insert(j, lo)
                self._ends.insert(j, hi)


class DecodeRing(DecodeStaging):
    def __init__(self, ctx: StagingContext) -> None:
        self.layout = ctx.layout
        self.kv = list(ctx.kv)
        buf = ctx.pool.allocate("staging_ring", (ctx.ring_bytes,), torch.uint8)
        self.tensor = buf.tensor
        self.region: MemoryRegion = buf.region
        self.alloc = RingAllocator(ctx.ring_bytes)
        self.scattered_bytes = 0
        self._lock = threading.Lock()  # scatters of different rooms may run in parallel

    def grant_bytes(self, num_pages: int, prefill_tp: int) -> int:
        return grant_geometry(prefill_tp, self.layout, num_pages).nbytes

    def reserve(self, nbytes: int) -> int | None:
        return self.alloc.alloc(nbytes)

    def free(self, offset: int) -> None:
        self.alloc.free(offset)

    def scatter(self, offset: int, dst_pages: np.ndarray, prefill_tp: int) -> None:
        lay = self.layout
        g = grant_geometry(prefill_tp, lay, len(dst_pages))
        d0, _ = lay.head_span
        dtype = self.kv[0][0].dtype
        for w in g.writers:
            n = g.tokens * w.token_bytes(lay)
            raw = self.tensor[offset + w.block_off: offset + w.block_off + n]
            block = raw.view(dtype).view(len(dst_pages), 2 * lay.num_layers, lay.page_size,
                                         w.count, lay.head_dim)
            scatter(self.kv, dst_pages, slice(w.first - d0, w.first - d0 + w.count), block)
            with self._lock:
                self.scattered_bytes += n

    def stats(self) -> dict[str, int]:
        return {"staging_ring_bytes": self.region.length,
                "staging_ring_used_bytes": self.alloc.used_bytes,
                "staging_scattered_bytes": self.scattered_bytes}

    def close(self) -> None:
        self.kv = []
