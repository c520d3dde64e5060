"""Memory pool `npu`: KV buffers in NPU memory (torch tensors on npu:<n>).

Aux rows (first token, logprobs, ...) are not allocated here: the core's AuxBuffers needs them in
host memory and takes them from a host pool when the KV pool is on a device. SGLang's Ascend path
keeps them on the NPU instead; see docs/ascend.md for why we do not.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pd_ascend import npu_runtime
from pd_ascend.platform import npu_index
from pdcore.errors import PDError, UnavailableError
from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import MemoryKind, MemoryRegion


class NpuMemoryPool(MemoryPool):
    name = "npu"

    def __init__(self, ctx: PoolContext) -> None:
        self.ctx = ctx
        if not str(ctx.device).startswith("npu"):
            raise PDError(f"the npu memory pool allocates NPU memory, but the server's device is "
                          f"{ctx.device!r}; run with --device npu, or pick a host pool "
                          f"(--memory-pool torch)")
        self.index = npu_index(ctx.device)
        ok, reason = npu_runtime.availability()
        if not ok:
            raise UnavailableError(f"memory pool 'npu' is not available here: {reason}")
        npu_runtime.load()  # registers the npu device type with torch
        self.device = torch.device(f"npu:{self.index}")
        self._buffers: dict[str, Buffer] = {}
        self._lock = threading.Lock()
        self._closed = False

    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        with self._lock:
            if self._closed:
                raise PDError("npu pool is closed; allocate before close()")
            if label in self._buffers:
                raise ValueError(f"npu pool: label {label!r} is already allocated; labels must be "
                                 f"unique within a pool")
            tensor = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
            region = MemoryRegion(addr=tensor.data_ptr(),
                                  length=tensor.numel() * tensor.element_size(),
                                  kind=MemoryKind.NPU, device_id=self.index, name=label)
            buf = Buffer(tensor=tensor, region=region)
            self._buffers[label] = buf
            return buf

    def close(self) -> None:
        # torch_npu frees the memory once the caller drops its tensors too; we drop ours
        with self._lock:
            self._closed = True
            self._buffers.clear()


def make_npu_pool(ctx: PoolContext) -> NpuMemoryPool:
    return NpuMemoryPool(ctx)
