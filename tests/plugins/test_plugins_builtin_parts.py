"""Built-in platform and pool details the contract suites do not reach."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdcore.builtin import platforms as plat
from pdcore.builtin.torch_pool import TorchMemoryPool
from pdcore.errors import ConfigError, PDError
from pdcore.interfaces.memory import PoolContext
from pdcore.interfaces.transfer import MemoryKind


def test_meminfo_parsing(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n"
                 "HugePages_Total:       0\n")
    assert plat._meminfo(f) == (400 * 1024, 1000 * 1024)
    f.write_text("MemTotal: 10 kB\nMemFree: 3 kB\n")  # old kernels: no MemAvailable
    assert plat._meminfo(f) == (3 * 1024, 10 * 1024)
    assert plat._meminfo(tmp_path / "missing") is None


def test_cgroup_limits(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    assert plat._cgroup_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text("2048\n")
    (tmp_path / "memory.current").write_text("512\n")
    assert plat._cgroup_limit(tmp_path) == (2048, 512)
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    assert plat._cgroup_limit(v1) is None


def test_host_memory_bounded_by_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plat, "_meminfo", lambda: (8 << 30, 16 << 30))
    monkeypatch.setattr(plat, "_cgroup_limit", lambda: (4 << 30, 3 << 30))
    info = plat.host_memory_info()
    assert (info.free_bytes, info.total_bytes) == (1 << 30, 4 << 30)
    monkeypatch.setattr(plat, "_cgroup_limit", lambda: None)
    assert plat.host_memory_info().total_bytes == 16 << 30


def test_real_host_memory_is_plausible() -> None:
    info = plat.CpuPlatform().memory_info(torch.device("cpu"))
    assert 0 < info.free_bytes <= info.total_bytes


def test_cuda_device_for_rank_and_reason() -> None:
    cuda = plat.CudaPlatform()
    if not torch.cuda.is_available():
        assert cuda.device_for_rank(1, base_gpu_id=2) == torch.device("cuda", 3)
        ok, reason = cuda.availability()
        assert not ok and reason.startswith("torch sees no CUDA device")
    with pytest.raises(ConfigError, match="must be >= 0"):
        cuda.device_for_rank(-1)
    assert plat.CpuPlatform().device_for_rank(5, base_gpu_id=3) == torch.device("cpu")
    assert (cuda.dist_backend, cuda.memory_kind, plat.CpuPlatform.dist_backend) == (
        "nccl", MemoryKind.CUDA, "gloo")


def test_torch_pool_refuses_bad_use() -> None:
    pool = TorchMemoryPool(PoolContext())
    buf = pool.allocate("a", (3, 5), torch.float16)
    assert (buf.region.kind, buf.region.name, buf.region.length) == (MemoryKind.HOST, "a", 30)
    assert set(pool.buffers()) == {"a"}
    pool.close()
    assert pool.buffers() == {}
    with pytest.raises(PDError, match="closed"):
        pool.allocate("b", (1,), torch.float32)
    with pytest.raises(PDError, match="host memory"):
        TorchMemoryPool(PoolContext(device="cuda:0"), pinned=True)
    with pytest.raises(PDError, match="cpu and cuda"):
        TorchMemoryPool(PoolContext(device="meta"))


def _rss_kib(addr: int) -> int:
    """Rss (kB) of the mapping holding `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_host_kv_pool_costs_nothing_until_written() -> None:
    """#45 item 14: the torch pool on a host zero-filled its whole buffer at start (1.8 GiB for
    a default server); now a buffer is untouched zero pages until a request writes it."""
    pool = TorchMemoryPool(PoolContext())
    try:
        buf = pool.allocate("k0", (64, 1 << 18), torch.float32)  # 64 MiB
        assert _rss_kib(buf.region.addr) < 1024
        assert not buf.tensor[::7].any()  # reads are zeros (and stay cheap)
        assert _rss_kib(buf.region.addr) < 1024
        buf.tensor[:4].fill_(1.0)  # 4 MiB written: about that much becomes resident
        assert 4096 <= _rss_kib(buf.region.addr) < 16 * 1024
        assert buf.tensor[:4].eq(1).all() and not buf.tensor[4:].any()
    finally:
        pool.close()
