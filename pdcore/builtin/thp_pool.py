"""`thp` memory pool: host memory in transparent huge pages, reachable by same-host peers.

Each buffer is its own private anonymous mapping, aligned to 2 MiB and advised MADV_HUGEPAGE
before its first touch; nothing is resident until the pool's requests write it. With THP set to
`madvise` (the common default) this is what gives the KV pool 2 MiB pages; ordinary
allocations and POSIX shared memory (unless shmem_enabled allows it) stay in 4 KiB pages, and a
copy into scattered KV pages then spends much of its time on page-table walks.

The `shm` backend writes into this pool from another process with process_vm_writev (its cma
mode); every other backend (tcp, mooncake, nixl) sees plain host memory. Labels, regions and
close() are the torch pool's; only where the memory comes from differs. Each mapping is
unmapped when the last tensor over it is freed.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from pdcore.builtin.torch_pool import TorchMemoryPool, untouched_zeros
from pdcore.errors import ConfigError
from pdcore.interfaces.memory import PoolContext

log = logging.getLogger(__name__)
HUGE = 2 << 20


class ThpMemoryPool(TorchMemoryPool):
    name = "thp"

    def __init__(self, ctx: PoolContext) -> None:
        if torch.device(ctx.device).type != "cpu":
            raise ConfigError(f"the thp memory pool holds host memory; device {ctx.device!r} is "
                              f"not supported. Use the platform's default pool")
        super().__init__(ctx)
        self.advised = hasattr(mmap, "MADV_HUGEPAGE")

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if math.prod(shape) <= 0:
            raise ValueError(f"thp pool: shape {shape} must hold at least one element")
        tensor, mm, offset = untouched_zeros(shape, dtype, align=HUGE)
        if self.advised:
            try:
                mm.madvise(mmap.MADV_HUGEPAGE, offset, len(mm) - offset)
            except OSError as e:  # THP compiled out: still correct, only slower
                self.advised = False
                log.warning("thp pool: madvise(MADV_HUGEPAGE) failed (%s); 4 KiB pages", e)
        # advised before the first touch: each 2 MiB the pool's requests write faults in as
        # one huge page; nothing is resident until then
        return tensor
