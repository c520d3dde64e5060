"""Pool, platform and planner contract suites run against the built-ins, and against
reference / deliberately broken implementations to prove the suites can fail."""

from __future__ import annotations

import pytest
from plugins_refplanner import RefPlanner, ShiftedPlanner

from pdcore.interfaces.planner import TransferPlanner
from pdcore.testing.planner_contract import SCENARIOS, PlannerContract
from pdcore.testing.platform_contract import PlatformContract
from pdcore.testing.pool_contract import PoolContract


class TestTorchPool(PoolContract):
    pool_name = "torch"


class TestPinnedPool(PoolContract):  # skips with its reason on a CPU-only machine
    pool_name = "pinned"


class TestShmPool(PoolContract):
    pool_name = "shm"


class TestThpPool(PoolContract):
    pool_name = "thp"


class TestCpuPlatform(PlatformContract):
    platform_name = "cpu"


class TestCudaPlatform(PlatformContract):  # availability checks run everywhere
    platform_name = "cuda"


class TestDefaultPlanner(PlannerContract):
    planner_name = "default"


class TestRefPlanner(PlannerContract):
    def make_planner(self) -> TransferPlanner:
        return RefPlanner()


class _Shifted(PlannerContract):
    def make_planner(self) -> TransferPlanner:
        return ShiftedPlanner()


def test_planner_contract_catches_misplaced_pages() -> None:
    with pytest.raises(AssertionError, match="wrong bytes"):
        _Shifted().test_moves_exactly_the_requested_bytes(SCENARIOS[0])


def test_pinned_pool_unavailable_reason_on_cpu() -> None:
    import torch

    from pdcore.plugins.host import memory_pools

    ok, reason = memory_pools().get("pinned").available()
    assert ok == torch.cuda.is_available()
    if not ok:
        assert reason.startswith("pinned host memory needs CUDA: torch sees no CUDA device")
