"""Device platform contract: cpu, cuda, npu ... registered through `pd_register_platforms`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pdcore.interfaces.transfer import MemoryKind


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    free_bytes: int
    total_bytes: int


class Platform(ABC):
    name: str = ""
    dist_backend: str = "gloo"  # torch.distributed backend for TP groups
    memory_kind: MemoryKind = MemoryKind.HOST
    default_pool: str = "torch"  # memory pool used when --memory-pool is not given

    @abstractmethod
    def availability(self) -> tuple[bool, str]:
        """(True, "") when usable here; else (False, why) — say what is missing."""

    @abstractmethod
    def device_for_rank(self, rank: int, base_gpu_id: int = 0) -> torch.device:
        """The torch device a TP rank runs on (base_gpu_id + rank for accelerators)."""

    @abstractmethod
    def memory_info(self, device: torch.device) -> MemoryInfo:
        """Free / total bytes on that device (host RAM for cpu)."""

    def synchronize(self, device: torch.device) -> None:
        """Wait for queued device work (no-op on cpu)."""
