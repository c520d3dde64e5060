"""Built-in `torch` and `pinned` memory pools: plain torch tensors on the context's device.

`pinned` allocates page-locked host memory (faster host<->GPU copies); it needs CUDA, so on a
CPU-only machine it is registered as unavailable with the reason.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdcore.builtin.platforms import cuda_availability
from pdcore.errors import PDError
from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import MemoryKind, MemoryRegion


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
        """A new zero-filled tensor (subclasses place the memory elsewhere)."""
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
