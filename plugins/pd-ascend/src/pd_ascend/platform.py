"""Platform `npu`: Ascend NPUs through torch-npu (device npu:{base_gpu_id + rank}, hccl)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pd_ascend import npu_runtime
from pd_ascend.settings import npu_phy_id
from pdcore.env import environ
from pdcore.errors import ConfigError, UnavailableError
from pdcore.interfaces.platform import MemoryInfo, Platform
from pdcore.interfaces.transfer import MemoryKind


def npu_index(device: torch.device | str) -> int:
    """"npu:3" / torch.device("npu", 3) -> 3. Parsed by hand: plain torch only knows the
    `npu` device type once torch_npu is imported."""
    kind, _, index = str(device).partition(":")
    if kind != "npu" or (index and not index.isdigit()):
        raise ConfigError(f"expected an NPU device such as 'npu:0', got {str(device)!r}")
    return int(index or 0)


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    memory_kind = MemoryKind.NPU
    default_pool = "npu"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        # the environment is read once, here, for ASCEND_NPU_PHY_ID
        self.env = environ() if env is None else dict(env)

    def availability(self) -> tuple[bool, str]:
        return npu_runtime.availability()

    def _require(self) -> None:
        ok, reason = self.availability()
        if not ok:
            raise UnavailableError(f"platform 'npu' is not available here: {reason}")

    def device_for_rank(self, rank: int, base_gpu_id: int = 0) -> torch.device:
        if rank < 0 or base_gpu_id < 0:
            raise ConfigError(f"rank ({rank}) and --base-gpu-id ({base_gpu_id}) must be >= 0")
        self._require()
        index, count = base_gpu_id + rank, npu_runtime.device_count()
        if index >= count:
            raise ConfigError(f"--base-gpu-id {base_gpu_id} + rank {rank} = npu:{index}, but only "
                              f"{count} NPU(s) are visible; lower --base-gpu-id or --tp-size, or "
                              f"check ASCEND_RT_VISIBLE_DEVICES")
        return torch.device("npu", index)

    def physical_id(self, device: torch.device | str) -> int:
        """The physical NPU id of a logical device (ASCEND_NPU_PHY_ID when the container
        renumbers devices). Mooncake's Ascend transport names its segments by it."""
        return npu_phy_id(self.env, npu_index(device))

    def memory_info(self, device: torch.device) -> MemoryInfo:
        self._require()
        free, total = npu_runtime.mem_get_info(npu_index(device))
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self, device: torch.device) -> None:
        self._require()
        npu_runtime.synchronize(npu_index(device))
