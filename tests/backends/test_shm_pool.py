"""shm memory pool: naming, alignment, zero fill, unlink on close, crash clean-up."""

from __future__ import annotations

import mmap
import multiprocessing
import os

import pytest
import torch

from pdcore.builtin import shm_segment as seg
from pdcore.builtin.shm_pool import ShmMemoryPool
from pdcore.errors import ConfigError
from pdcore.interfaces.memory import PoolContext
from pdcore.interfaces.transfer import MemoryKind


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(seg.SHM_DIR, name))


def test_allocate_region_and_close() -> None:
    pool = ShmMemoryPool(PoolContext(server_id="pooltest_a"))
    try:
        buf = pool.allocate("layer0/k", (7, 16, 3, 64), torch.float32)
        assert buf.tensor.shape == (7, 16, 3, 64) and buf.tensor.dtype == torch.float32
        assert not buf.tensor.any()
        r = buf.region
        assert r.kind is MemoryKind.SHM and r.offset == 0
        assert r.name == f"pdserve_pooltest-a_{os.getpid()}_layer0-k"
        assert r.addr == buf.tensor.data_ptr() and r.addr % mmap.PAGESIZE == 0
        assert r.length == 7 * 16 * 3 * 64 * 4
        assert os.path.getsize(os.path.join(seg.SHM_DIR, r.name)) % mmap.PAGESIZE == 0
        buf.tensor.fill_(1.5)
        with pytest.raises(ValueError, match="already allocated"):
            pool.allocate("layer0/k", (1,), torch.float32)
        with pytest.raises(ValueError, match="at least one element"):
            pool.allocate("empty", (0, 4), torch.float32)
        aux = pool.allocate("aux", (10,), torch.int64)
        assert exists(r.name) and exists(aux.region.name)
    finally:
        pool.close()
        pool.close()
    assert not exists(r.name) and not exists(aux.region.name)
    assert float(buf.tensor[0, 0, 0, 0]) == 1.5  # the mapping outlives the name


def test_refuses_accelerator_device() -> None:
    with pytest.raises(ConfigError, match="host memory"):
        ShmMemoryPool(PoolContext(device="meta"))


def _allocate_and_hang(server_id: str, conn) -> None:
    pool = ShmMemoryPool(PoolContext(server_id=server_id))
    bufs = [pool.allocate(f"k{i}", (1024,), torch.float32) for i in range(3)]
    conn.send([b.region.name for b in bufs])
    conn.recv()  # killed while waiting here: never closes its pool


def test_stale_segments_of_killed_process_are_removed() -> None:
    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    p = mp.Process(target=_allocate_and_hang, args=("pooltest-dead", child), daemon=True)
    p.start()
    try:
        assert parent.poll(120), "child did not allocate"
        names = parent.recv()
        assert all(exists(n) for n in names)
        # a live owner's segments are left alone
        ShmMemoryPool(PoolContext(server_id="pooltest-b")).close()
        assert all(exists(n) for n in names)
    finally:
        p.kill()
        p.join(10)
    survivor = ShmMemoryPool(PoolContext(server_id="pooltest-c"))
    try:
        assert set(names) <= set(survivor.removed_stale)
        assert not any(exists(n) for n in names)
    finally:
        survivor.close()


def test_segment_name_parsing() -> None:
    name = seg.segment_name("srv_1", 1234, "layer_3/v")
    assert name == "pdserve_srv-1_1234_layer-3-v" and seg.owner_pid(name) == 1234
    assert seg.owner_pid("pdserve_x_notapid_k") is None
    assert seg.owner_pid("other_x_12_k") is None
    assert not seg.pid_alive(0)
    assert seg.pid_alive(os.getpid())


def test_segment_larger_than_dev_shm_fails_clearly() -> None:
    """Space is reserved at allocation, so a too-small /dev/shm is an error now, not a SIGBUS
    later. (tmpfs refuses a reservation larger than the whole file system at once.)"""
    import shutil

    too_big = shutil.disk_usage(seg.SHM_DIR).total + (1 << 20)
    pool = ShmMemoryPool(PoolContext(server_id="pooltest-big"))
    try:
        with pytest.raises(ConfigError, match="--shm-size"):
            pool.allocate("huge", (too_big,), torch.uint8)
        assert not any(n.startswith("pdserve_pooltest-big_") for n in os.listdir(seg.SHM_DIR))
    finally:
        pool.close()
