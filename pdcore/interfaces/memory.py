"""Memory pool contract: where a server's KV and aux buffers live.

A pool factory (registered through `pd_register_memory_pools`) gets a PoolContext and returns a
MemoryPool. The KV cache asks it for named buffers; each comes back as a torch tensor plus the
MemoryRegion describing it (what the transfer backend registers and the peer addresses).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pdcore.interfaces.transfer import MemoryRegion


@dataclass(frozen=True, slots=True)
class PoolContext:
    server_id: str = ""  # unique per server; names of shared segments derive from it
    device: str = "cpu"  # torch device string, e.g. "cpu", "cuda:1"
    rank: int = 0
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Buffer:
    tensor: torch.Tensor
    region: MemoryRegion


class MemoryPool(ABC):
    name: str = ""

    @abstractmethod
    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        """A zero-filled contiguous tensor and its region. `label` is unique within the pool."""

    @abstractmethod
    def close(self) -> None:
        """Release every buffer (unlink shared segments, ...); idempotent."""
