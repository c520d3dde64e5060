"""Page allocator with reference counts: a page returns to the free list when its last holder
frees it (parallel samples share their prompt's pages; see pdcore.engine.sched.fork).

The free list is a stack (LIFO): the page freed last is handed out first, and pages never used
come in ascending order after every freed one. A host KV pool is untouched zeros (the kernel's
zero pages, builtin/torch_pool.py), so with LIFO a server keeps resident only the pages its
busiest moment needed; a FIFO queue walked the whole pool (every page faulted in) before it
reused any. A reused page holds its last owner's K/V: the new owner writes each position
before attention reads it (prefill and decode store K/V first; attention reads positions
below the sequence's length only), tests/engine/test_kv_lifo.py attacks exactly that."""

from __future__ import annotations

import torch

SMALL_SPAN = 32  # spans up to this many positions are computed without tensor ops


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() is next
        self._ref = [0] * num_pages
        self._written: set[int] = set()  # handed out since the last take_free_written()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._ref[p] = 1
        self._written.update(out)
        return out

    def ref(self, pages: list[int]) -> list[int]:
        """One more holder for each of `pages` (already allocated); returns them."""
        for p in pages:
            assert self._ref[p] > 0, f"page {p} is free; only an allocated page can be shared"
            self._ref[p] += 1
        return list(pages)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self._ref[p] > 0, f"page {p} freed twice"
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    def take_free_written(self) -> list[int]:
        """The pages handed out since the last call that are free now (written K/V nobody
        holds: engine/kv/giveback.py hands them back at idle); pages still held stay noted."""
        ref = self._ref
        done = [p for p in self._written if ref[p] == 0]
        self._written.difference_update(done)
        return done

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Pool slot index of every position in [start, end) of a sequence with `pages`."""
        ps = self.page_size
        if end - start <= SMALL_SPAN:  # a decode token: plain ints (tensor indexing costs ~50 us)
            return torch.tensor([pages[p // ps] * ps + p % ps for p in range(start, end)],
                                dtype=torch.long)
        pos = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size
