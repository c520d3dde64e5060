"""Helpers shared by the shm backend tests (segment and cma modes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from pdcore.builtin.shm_backend import ShmTransferEngine
from pdcore.interfaces.memory import MemoryPool
from pdcore.interfaces.transfer import BackendContext, CopyBatch

REGION = 1 << 20


def batch(src: list[int], dst: list[int], length: list[int]) -> CopyBatch:
    u = np.uint64
    return CopyBatch(np.array(src, dtype=u), np.array(dst, dtype=u), np.array(length, dtype=u))


@contextmanager
def sending_engine(pool: MemoryPool, server_id: str, seed: int, workers: int
                   ) -> Iterator[tuple[ShmTransferEngine, int, np.ndarray]]:
    """(engine, address of its 4 * REGION random source bytes in `pool`, those bytes)."""
    try:
        buf = pool.allocate("src", (4 * REGION,), torch.uint8)
        data = np.random.default_rng(seed).integers(0, 256, 4 * REGION, dtype=np.uint8)
        buf.tensor.copy_(torch.from_numpy(data))
        eng = ShmTransferEngine(BackendContext(server_id=server_id, thread_pool_size=workers))
        try:
            eng.register([buf.region])
            yield eng, buf.region.addr, data
        finally:
            eng.close()
    finally:
        pool.close()
