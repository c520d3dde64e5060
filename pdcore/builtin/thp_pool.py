"""`thp` memory pool: host memory in transparent huge pages, reachable by same-host peers.

Each buffer is its own private anonymous mapping, aligned to 2 MiB and advised MADV_HUGEPAGE
before its first touch, then zero-filled (resident, as torch.zeros would be). With THP set to
`madvise` (the common default) this is what gives the KV pool 2 MiB pages; ordinary
allocations and POSIX shared memory (unless shmem_enabled allows it) stay in 4 KiB pages, and a
copy into scattered KV pages then spends much of its time on page-table walks.

The `shm` backend writes into this pool from another process with process_vm_writev (its cma
mode); every other backend (tcp, mooncake, nixl) sees plain host memory.
Lifecycle: allocate() maps; close() drops the pool's references, and each mapping is unmapped
when the last tensor over it is freed.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from collections.abc import Sequence

import torch

from pdcore.builtin.shm_segment import address_of
from pdcore.errors import ConfigError
from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import MemoryKind, MemoryRegion

log = logging.getLogger(__name__)
HUGE = 2 << 20


class ThpMemoryPool(MemoryPool):
    name = "thp"

    def __init__(self, ctx: PoolContext) -> None:
        if torch.device(ctx.device).type != "cpu":
            raise ConfigError(f"the thp memory pool holds host memory; device {ctx.device!r} is "
                              f"not supported. Use the platform's default pool")
        self.ctx = ctx
        self._buffers: dict[str, Buffer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.advised = hasattr(mmap, "MADV_HUGEPAGE")

    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        if numel <= 0 or any(s < 0 for s in shape):
            raise ValueError(f"thp pool: shape {shape} of {label!r} must hold at least one element")
        with self._lock:
            if self._closed:
                raise ConfigError("thp pool is closed; create a new one")
            if label in self._buffers:
                raise ValueError(f"thp pool: label {label!r} is already allocated; labels must "
                                 f"be unique within a pool")
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            offset = -address_of(mm) % HUGE
            if self.advised:
                try:
                    mm.madvise(mmap.MADV_HUGEPAGE, offset, len(mm) - offset)
                except OSError as e:  # THP compiled out: still correct, only slower
                    self.advised = False
                    log.warning("thp pool: madvise(MADV_HUGEPAGE) failed (%s); 4 KiB pages", e)
            tensor = torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape)
            tensor.zero_()  # fault every page in now, as huge pages
            region = MemoryRegion(addr=tensor.data_ptr(), length=nbytes, kind=MemoryKind.HOST,
                                  device_id=0, name=label)
            buf = Buffer(tensor=tensor, region=region)
            self._buffers[label] = buf
            return buf

    def buffers(self) -> dict[str, Buffer]:
        with self._lock:
            return dict(self._buffers)

    def close(self) -> None:
        # Never mmap.close(): tensors over the mapping may still be alive (see shm_pool).
        with self._lock:
            self._closed = True
            self._buffers.clear()
