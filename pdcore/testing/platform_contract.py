"""Contract suite for device platforms.

    from pdcore.testing.platform_contract import PlatformContract

    class TestMyPlatform(PlatformContract):
        platform_name = "npu"                # or override make_platform()

Checks that hold everywhere: the factory returns a Platform whose name is the registered one;
availability() answers (bool, str) with a reason when False, and agrees with the registry's
probe; the default pool is a registered pool. Where the platform is available: device_for_rank
maps (rank, base_gpu_id) to the right device (or refuses a device that does not exist with a
clear error), a tensor can be made there, memory_info is sane, synchronize works.
"""

from __future__ import annotations

import pytest
import torch

from pdcore.errors import PDError
from pdcore.interfaces.platform import MemoryInfo, Platform
from pdcore.interfaces.transfer import MemoryKind
from pdcore.plugins.host import memory_pools, platforms


class PlatformContract:
    platform_name: str = ""

    def make_platform(self) -> Platform:
        # the factory itself, not Registry.create: availability is part of what we test
        return platforms().get(self.platform_name).factory()

    @pytest.fixture
    def platform(self) -> Platform:
        return self.make_platform()

    @pytest.fixture
    def available_platform(self, platform: Platform) -> Platform:
        ok, reason = platform.availability()
        if not ok:
            pytest.skip(f"platform {self.platform_name!r} is unavailable here: {reason}")
        return platform

    def test_declarations(self, platform: Platform) -> None:
        assert isinstance(platform, Platform)
        assert platform.name == self.platform_name
        assert isinstance(platform.dist_backend, str) and platform.dist_backend
        assert isinstance(platform.memory_kind, MemoryKind)
        assert isinstance(platform.default_pool, str) and platform.default_pool

    def test_default_pool_is_registered(self, platform: Platform) -> None:
        assert platform.default_pool in memory_pools(), (
            f"default pool {platform.default_pool!r} is not registered; "
            f"installed: {memory_pools().names()}")

    def test_availability_answer(self, platform: Platform) -> None:
        answer = platform.availability()
        assert isinstance(answer, tuple) and len(answer) == 2
        ok, reason = answer
        assert isinstance(ok, bool) and isinstance(reason, str)
        if not ok:
            assert reason.strip(), "an unavailable platform must say why"
        assert platforms().get(self.platform_name).available()[0] == ok, (
            "the registered availability probe disagrees with Platform.availability()")

    def test_device_for_rank(self, available_platform: Platform) -> None:
        p = available_platform
        d0 = p.device_for_rank(0)
        assert isinstance(d0, torch.device)
        for rank, base in ((0, 0), (1, 0), (0, 1), (2, 1)):
            try:
                d = p.device_for_rank(rank, base_gpu_id=base)
            except PDError as e:  # a device that does not exist here: must be refused clearly
                assert d0.type != "cpu" and str(e), "cpu must map every rank"
                continue
            assert d.type == d0.type
            if d.type != "cpu":
                assert d.index == base + rank, f"rank {rank} base {base} -> {d}"
        with pytest.raises((ValueError, PDError)):
            p.device_for_rank(-1)

    def test_tensor_on_device(self, available_platform: Platform) -> None:
        device = available_platform.device_for_rank(0)
        t = torch.ones(8, device=device) * 2
        available_platform.synchronize(device)
        assert float(t.sum().cpu()) == 16.0

    def test_memory_info(self, available_platform: Platform) -> None:
        info = available_platform.memory_info(available_platform.device_for_rank(0))
        assert isinstance(info, MemoryInfo)
        assert info.total_bytes > 0
        assert 0 <= info.free_bytes <= info.total_bytes
