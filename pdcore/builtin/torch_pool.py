"""Built-in `torch` and `pinned` memory pools: plain torch tensors on the context's device.

`pinned` allocates page-locked host memory (faster host<->GPU copies); it needs CUDA, so on a
CPU-only machine it is registered as unavailable with the reason.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Sequence

import torch

from pdcore.builtin.platforms import cuda_availability
from pdcore.builtin.shm_segment import address_of
from pdcore.errors import PDError
from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import MemoryKind, MemoryRegion


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                    align: int = 0) -> tuple[torch.Tensor, mmap.mmap, int]:
    """A zero tensor over a private anonymous mapping that nothing has touched: its pages
    become resident when first written (reads of untouched pages share the kernel's zero
    page). `align`: the tensor starts at a multiple of it (the mapping is that much longer).
    Returns (tensor, mapping, offset of the tensor in it). The mapping is never closed here:
    torch.frombuffer keeps it alive as long as a tensor over it lives."""
    numel = math.prod(shape)
    if numel <= 0:
        raise ValueError(f"shape {shape} must hold at least one element")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mm = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -address_of(mm) % align if align else 0
    tensor = torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape)
    return tensor, mm, offset


def pinned_availability() -> tuple[bool, str]:
    ok, reason = cuda_availability()
    return (True, "") if ok else (False, f"pinned host memory needs CUDA: {reason}")


class TorchMemoryPool(MemoryPool):
    """Buffers are torch.zeros on ctx.device; the pool keeps them alive until close()."""

    name = "torch"

    def __init__(self, ctx: PoolContext, pinned: bool = False) -> None:
        self.ctx = ctx
        self.device = torch.device(ctx.device)
        self.pinned = pinned
        if pinned:
            self.name = "pinned"
            if self.device.type != "cpu":
                raise PDError(f"the pinned pool allocates host memory; got device {ctx.device!r}"
                              f" (use the `torch` pool for device memory)")
        self.kind = MemoryKind.HOST if self.device.type == "cpu" else MemoryKind.CUDA
        if self.device.type not in ("cpu", "cuda"):
            raise PDError(f"the {self.name} pool supports cpu and cuda devices, not "
                          f"{ctx.device!r}; pick the memory pool of your platform plugin")
        self._buffers: dict[str, Buffer] = {}
        self._lock = threading.Lock()
        self._closed = False

    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        with self._lock:
            if self._closed:
                raise PDError(f"{self.name} pool is closed; allocate before close()")
            if label in self._buffers:
                raise ValueError(f"{self.name} pool: label {label!r} is already allocated; "
                                 f"labels must be unique within a pool")
            tensor = self._zeros(tuple(int(n) for n in shape), dtype)
            region = MemoryRegion(
                addr=tensor.data_ptr(),
                length=tensor.numel() * tensor.element_size(),
                kind=self.kind,
                device_id=self.device.index or 0,
                name=label,
            )
            buf = Buffer(tensor=tensor, region=region)
            self._buffers[label] = buf
            return buf

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new zero-filled tensor (subclasses place the memory elsewhere). Host memory is a
        fresh anonymous mapping: the kernel's zero pages, none resident until written, so a
        KV pool costs the memory its requests use, not its size (#45 item 14: torch.zeros
        wrote every byte of a 1.8 GiB pool at start)."""
        if self.device.type == "cpu" and not self.pinned:
            return untouched_zeros(shape, dtype)[0]
        return torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=self.pinned)

    def buffers(self) -> dict[str, Buffer]:
        with self._lock:
            return dict(self._buffers)

    def close(self) -> None:
        # torch frees the memory once the caller drops its tensors too; we drop ours.
        with self._lock:
            self._closed = True
            self._buffers.clear()


def make_torch_pool(ctx: PoolContext) -> TorchMemoryPool:
    return TorchMemoryPool(ctx)


def make_pinned_pool(ctx: PoolContext) -> TorchMemoryPool:
    return TorchMemoryPool(ctx, pinned=True)
