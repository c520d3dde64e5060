"""Prefill side: per-worker staging buffers and the gather of a chunk's head slices.

1. `PrefillBuffers` allocates one buffer of SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB per transfer
   worker from the KV memory pool (registered with the backend next to the KV);
2. `stage()` takes a free buffer (a worker never waits for another's), gathers the chunk's
   pages, for the heads the decode rank needs, in the grant's page-major order, and yields one
   copy descriptor: buffer -> the writer's block in decode's grant at the chunk's offset;
3. the buffer is free again once the write finished (the context exits). A chunk larger than a
   buffer raises TransferError: that request fails, the server does not.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from pd_staging.copies import gather
from pd_staging.geometry import grant_geometry
from pdcore.errors import TransferError
from pdcore.interfaces.planner import KVLayout, PrefillStaging, StagingContext
from pdcore.interfaces.transfer import CopyBatch

ACQUIRE_TIMEOUT_S = 60.0


class PrefillBuffers(PrefillStaging):
    def __init__(self, ctx: StagingContext) -> None:
        self.layout = ctx.layout
        self.kv = list(ctx.kv)
        self.buffer_bytes = ctx.buffer_bytes
        bufs = [ctx.pool.allocate(f"staging_buf{i}", (ctx.buffer_bytes,), torch.uint8)
                for i in range(max(1, ctx.workers))]
        self._bufs = bufs
        self.regions = tuple(b.region for b in bufs)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(bufs)):
            self._free.put(i)
        self.gathered_bytes = 0
        self._lock = threading.Lock()

    @contextmanager
    def stage(self, dst: KVLayout, src_pages: np.ndarray, page_start: int, dst_num_pages: int,
              dst_addr: int, dst_len: int) -> Iterator[CopyBatch]:
        src = self.layout
        g = grant_geometry(src.tp_size, dst, dst_num_pages)
        w = g.writer(src.tp_rank)
        pages = np.asarray(src_pages, dtype=np.int64).ravel()
        tokens = len(pages) * src.page_size
        per_token = w.token_bytes(src)
        nbytes = tokens * per_token
        if nbytes > self.buffer_bytes:
            raise TransferError(
                f"a chunk of {tokens} tokens needs {nbytes / 2**20:.2f} MiB of staging buffer, "
                f"SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB gives {self.buffer_bytes / 2**20:.2f} MiB;"
                f" raise it or lower --chunked-prefill-size")
        offset = w.block_off + page_start * src.page_size * per_token
        if offset + nbytes > min(g.nbytes, dst_len):
            raise TransferError(f"chunk [{offset}, {offset + nbytes}) does not fit the room's "
                                f"{dst_len}-byte staging grant")
        try:
            i = self._free.get(timeout=ACQUIRE_TIMEOUT_S)
        except queue.Empty:
            raise TransferError(f"no staging buffer free after {ACQUIRE_TIMEOUT_S:g}s") from None
        try:
            buf = self._bufs[i]
            self._gather(buf.tensor[:nbytes], pages, w.first - src.head_span[0], w.count)
            with self._lock:
                self.gathered_bytes += nbytes
            yield CopyBatch(np.array([buf.region.addr], dtype=np.uint64),
                            np.array([dst_addr + offset], dtype=np.uint64),
                            np.array([nbytes], dtype=np.uint64))
        finally:
            self._free.put(i)

    def _gather(self, raw: torch.Tensor, pages: np.ndarray, h0: int, count: int) -> None:
        lay = self.layout
        out = raw.view(self.kv[0][0].dtype).view(len(pages), 2 * lay.num_layers,
                                                 lay.page_size, count, lay.head_dim)
        gather(self.kv, pages, slice(h0, h0 + count), out)

    def close(self) -> None:
        self.kv = []
