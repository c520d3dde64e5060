"""Built-in platforms: `cpu` (always usable) and `cuda` (where torch sees a CUDA device)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pdcore.errors import ConfigError
from pdcore.interfaces.platform import MemoryInfo, Platform
from pdcore.interfaces.transfer import MemoryKind

_UNLIMITED = 1 << 60  # cgroup files say "max"; anything above this is "no limit"


def _meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int] | None:
    """(available, total) bytes from /proc/meminfo, or None where it does not exist."""
    try:
        text = path.read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" not in values:
        return None
    available = values.get("MemAvailable", values.get("MemFree", 0))
    return available, values["MemTotal"]


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def _cgroup_limit(root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(limit, used) bytes of this process's memory cgroup (v2, then v1), or None if unlimited.

    Why: in a container /proc/meminfo shows the host; the KV pool must fit the container.
    """
    for limit_file, used_file in (("memory.max", "memory.current"),
                                  ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _read_int(root / limit_file)
        if limit is not None and limit < _UNLIMITED:
            return limit, _read_int(root / used_file) or 0
    return None


def host_memory_info() -> MemoryInfo:
    """Free / total host RAM, bounded by the memory cgroup when there is one."""
    info = _meminfo()
    if info is None:  # not Linux: sysconf still knows physical pages
        page = os.sysconf("SC_PAGE_SIZE")
        info = (os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page)
    free, total = info
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limit, used = cgroup
        total = min(total, limit)
        free = min(free, max(limit - used, 0))
    return MemoryInfo(free_bytes=min(free, total), total_bytes=total)


def _check_rank(rank: int, base_gpu_id: int) -> None:
    if rank < 0 or base_gpu_id < 0:
        raise ConfigError(f"rank ({rank}) and --base-gpu-id ({base_gpu_id}) must be >= 0")


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    memory_kind = MemoryKind.HOST
    default_pool = "torch"

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def device_for_rank(self, rank: int, base_gpu_id: int = 0) -> torch.device:
        _check_rank(rank, base_gpu_id)
        return torch.device("cpu")

    def memory_info(self, device: torch.device) -> MemoryInfo:
        return host_memory_info()


def cuda_availability() -> tuple[bool, str]:
    if torch.cuda.is_available():
        return True, ""
    if torch.version.cuda is None:
        return False, f"torch sees no CUDA device (torch {torch.__version__} is a CPU-only build)"
    return False, "torch sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)"


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    memory_kind = MemoryKind.CUDA
    default_pool = "torch"

    def availability(self) -> tuple[bool, str]:
        return cuda_availability()

    def device_for_rank(self, rank: int, base_gpu_id: int = 0) -> torch.device:
        _check_rank(rank, base_gpu_id)
        index = base_gpu_id + rank
        if torch.cuda.is_available() and index >= torch.cuda.device_count():
            raise ConfigError(
                f"--base-gpu-id {base_gpu_id} + rank {rank} = cuda:{index}, but only "
                f"{torch.cuda.device_count()} CUDA device(s) are visible; lower --base-gpu-id "
                f"or --tp-size"
            )
        return torch.device("cuda", index)

    def memory_info(self, device: torch.device) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(torch.device(device))
