"""Mooncake CUDA memory pools (SGLANG_MOONCAKE_CUSTOM_MEM_POOL): KV buffers Mooncake can move
over NVLink.

- `mooncake-nvlink` (NVLINK / True, with MC_FORCE_MNNVL): tensors from Mooncake's NVLink
  allocator through a torch.cuda.MemPool;
- `mooncake-barex` (BAREX): the same with Mooncake's Barex allocator;
- `mooncake-intra-node-nvlink` (INTRA_NODE_NVLINK, with MC_INTRANODE_NVLINK): ordinary CUDA
  tensors; the engine's intra-node NVLink transport does the work.

Lifecycle: 1. the factory checks CUDA and the wheel (ConfigError with the reason otherwise);
2. `allocate` returns zeroed tensors and their CUDA regions; 3. `close` drops every tensor and
the pool. Needs CUDA: on CPU machines the tests skip and availability says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from pd_mooncake import engine
from pdcore.errors import ConfigError
from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import MemoryKind, MemoryRegion


class MooncakeCudaPool(MemoryPool):
    def __init__(self, ctx: PoolContext, kind: str, name: str) -> None:
        ok, reason = engine.cuda_pool_support(kind)
        if not ok:
            raise ConfigError(f"memory pool {name!r} cannot be used here: {reason}")
        if not ctx.device.startswith("cuda"):
            raise ConfigError(f"memory pool {name!r} needs a CUDA device, the server runs on "
                              f"{ctx.device!r}; pass --device cuda")
        self.name = name
        self.kind = kind
        self.device = torch.device(ctx.device)
        self._mem_pool: torch.cuda.MemPool | None = None
        if kind in ("NVLINK", "BAREX"):
            allocator = engine.custom_allocator_class(kind).get_allocator(self.device)
            self._mem_pool = torch.cuda.MemPool(allocator.allocator())
        self._buffers: dict[str, Buffer] = {}

    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        if label in self._buffers:
            raise ValueError(f"buffer {label!r} already allocated in pool {self.name!r}")
        ctx = (torch.cuda.use_mem_pool(self._mem_pool, device=self.device)
               if self._mem_pool is not None else contextlib.nullcontext())
        with ctx:
            tensor = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        region = MemoryRegion(addr=tensor.data_ptr(), length=tensor.numel() * tensor.element_size(),
                              kind=MemoryKind.CUDA, device_id=index, name=label)
        buf = Buffer(tensor, region)
        self._buffers[label] = buf
        return buf

    def close(self) -> None:
        self._buffers.clear()
        self._mem_pool = None

