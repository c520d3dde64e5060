"""shm backend across processes: bytes, bounds, host identity, peer loss, unmapping."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pdcore.backendkit import split_by_bytes
from pdcore.builtin import shm_copy
from pdcore.builtin.shm_backend import ShmTransferEngine
from pdcore.builtin.shm_pool import ShmMemoryPool
from pdcore.errors import TransferError
from pdcore.interfaces.memory import PoolContext
from pdcore.interfaces.transfer import BackendContext, MemoryRegion, TransferStatus
from pdcore.testing.remote import ReceiverSpec, RemoteReceiver, sentinel

from .shm_util import REGION, batch, sending_engine


def mapped_names() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def sender():
    with sending_engine(ShmMemoryPool(PoolContext(server_id="shmtest-p")), "shmtest-p", 1,
                        4) as s:
        yield s


@pytest.fixture
def remote():
    with RemoteReceiver(ReceiverSpec("shm", "", "shm", "cpu", REGION, 2, seed=4)) as r:
        yield r


def test_bytes_arrive_and_big_batches_split(sender, remote) -> None:
    eng, base, data = sender
    peer = eng.connect(remote.endpoint, remote.regions)
    r0, r1 = remote.regions
    # many page-sized items (some merged into runs) + odd sizes; > CHUNK_BYTES total is not
    # needed for correctness but 256 x 4 KiB pages exercise the vectorised path
    pages = np.random.default_rng(2).permutation(256)[:200]
    src = [base + int(p) * 4096 for p in pages] + [base + 3 * REGION + 1]
    dst = [r0.addr + i * 4096 for i in range(200)] + [r1.addr + 7]
    lens = [4096] * 200 + [REGION - 7]
    assert eng.wait(eng.write(peer, batch(src, dst, lens)), 20).status is TransferStatus.DONE
    exp0 = sentinel(4, 0, REGION)
    for i, p in enumerate(pages):
        exp0[i * 4096:(i + 1) * 4096] = data[p * 4096:(p + 1) * 4096]
    exp1 = sentinel(4, 1, REGION)
    exp1[7:] = data[3 * REGION + 1:3 * REGION + 1 + REGION - 7]
    assert np.array_equal(remote.read(0), exp0)
    assert np.array_equal(remote.read(1), exp1)


def test_split_across_workers_is_exact(sender) -> None:
    """Batches above CHUNK_BYTES go to several workers; each byte must still land once."""
    eng, base, data = sender
    pool = ShmMemoryPool(PoolContext(server_id="shmtest-d"))
    eng_d = ShmTransferEngine(BackendContext(server_id="shmtest-d"))
    try:
        dst = pool.allocate("dst", (4 * REGION,), torch.uint8)
        peer = eng.connect(eng_d.endpoint(), [dst.region])
        n = 4 * REGION // 12288
        order = np.random.default_rng(3).permutation(n)
        b = batch([base + int(i) * 12288 for i in order],
                  [dst.region.addr + j * 12288 for j in range(n)], [12288] * n)
        eng.chunk_bytes = 1 << 20
        assert len(split_by_bytes(b.length, eng.workers, eng.chunk_bytes)) == 3  # 4 MiB / 1 MiB chunks, 341 items
        assert eng.wait(eng.write(peer, b), 20).status is TransferStatus.DONE
        got = dst.tensor.numpy()
        want = data[:n * 12288].reshape(n, 12288)[order].ravel()
        assert np.array_equal(got[:n * 12288], want)
    finally:
        eng_d.close()
        pool.close()


@pytest.mark.parametrize("pool", ["shm", "thp"])  # segment mode, cma mode
def test_out_of_range_dst_rejected_nothing_written(sender, pool) -> None:
    if pool == "thp" and not shm_copy.cma_permitted()[0]:
        pytest.skip(f"cma not permitted here: {shm_copy.cma_permitted()[1]}")
    eng, base, _ = sender
    with RemoteReceiver(ReceiverSpec("shm", "", pool, "cpu", REGION, 2, seed=4)) as remote:
        peer = eng.connect(remote.endpoint, remote.regions)
        r0, r1 = remote.regions
        res = eng.wait(eng.write(peer, batch([base, base], [r1.addr, r0.end - 10], [100, 11])))
        assert res.status is TransferStatus.FAILED
        assert "dst item 1" in res.reason and "nothing was copied" in res.reason
        assert np.array_equal(remote.read(0), sentinel(4, 0, REGION))
        assert np.array_equal(remote.read(1), sentinel(4, 1, REGION))
        if pool == "shm":  # a lying peer region bigger than its segment: refused at connect
            lie = [MemoryRegion(r0.addr, 64 * REGION, r0.kind, name=r0.name)]
            with pytest.raises(TransferError, match="does not fit"):
                eng.connect(remote.endpoint, lie)


def test_other_host_refused_before_mapping(remote) -> None:
    eng = ShmTransferEngine(BackendContext(env={"PDCORE_HOST_ID": "some-other-host"}))
    try:
        with pytest.raises(TransferError, match="same host.*--backend tcp"):
            eng.connect(remote.endpoint, remote.regions)
        assert not any(r.name in mapped_names() for r in remote.regions)
    finally:
        eng.close()


def test_foreign_segment_names_refused(sender, remote) -> None:
    eng, _, _ = sender
    r0 = remote.regions[0]
    for name in ("pdserve_x_1_k0", "../../etc/passwd", "someone-elses-segment"):
        fake = MemoryRegion(r0.addr, r0.length, r0.kind, name=name)
        with pytest.raises(TransferError):
            eng.connect(remote.endpoint, [fake])


def test_killed_peer_fails_and_is_unmapped(sender, remote) -> None:
    eng, base, _ = sender
    peer = eng.connect(remote.endpoint, remote.regions)
    r0 = remote.regions[0]
    assert eng.wait(eng.write(peer, batch([base], [r0.addr], [64]))).status is TransferStatus.DONE
    assert r0.name in mapped_names()
    remote.kill()
    t0 = time.monotonic()
    res = eng.wait(eng.write(peer, batch([base], [r0.addr], [64])), 10)
    assert res.status is TransferStatus.FAILED and "exited" in res.reason
    assert time.monotonic() - t0 < 3
    assert wait_until(lambda: r0.name not in mapped_names()), "peer segment still mapped"
    again = eng.poll(eng.write(peer, batch([base], [r0.addr], [64])))
    assert again.status is TransferStatus.FAILED


def test_closed_peer_engine_detected_and_disconnect_unmaps(sender) -> None:
    eng, base, _ = sender
    pool = ShmMemoryPool(PoolContext(server_id="shmtest-d2"))
    other = ShmTransferEngine(BackendContext(server_id="shmtest-d2"))
    try:
        dst = pool.allocate("dst", (REGION,), torch.uint8)
        name = dst.region.name
        assert mapped_names().count(name) == 1  # the pool's own mapping
        peer = eng.connect(other.endpoint(), [dst.region])
        assert mapped_names().count(name) == 2
        eng.disconnect(peer)
        assert mapped_names().count(name) == 1
        assert eng.poll(eng.write(peer, batch([base], [dst.region.addr], [8]))).status \
            is TransferStatus.FAILED
        peer = eng.connect(other.endpoint(), [dst.region])
        other.close()
        res = eng.poll(eng.write(peer, batch([base], [dst.region.addr], [8])))
        assert res.status is TransferStatus.FAILED and "engine closed" in res.reason
        assert wait_until(lambda: mapped_names().count(name) == 1)
        with pytest.raises(TransferError, match="closed its engine"):
            eng.connect(other.endpoint(), [dst.region])
    finally:
        other.close()
        pool.close()


def test_peer_without_host_or_shm_regions_refused(sender) -> None:
    from pdcore.interfaces.transfer import MemoryKind

    eng, _, _ = sender
    other = ShmTransferEngine(BackendContext())
    try:
        with pytest.raises(TransferError, match="--memory-pool shm"):
            eng.connect(other.endpoint(), [MemoryRegion(1 << 30, 64, MemoryKind.CUDA)])
    finally:
        other.close()


def test_copy_strategy_setting_is_validated() -> None:
    from pdcore.errors import ConfigError

    with pytest.raises(ConfigError, match="PDCORE_SHM_COPY"):
        ShmTransferEngine(BackendContext(env={"PDCORE_SHM_COPY": "fastest"}))

    eng = ShmTransferEngine(BackendContext())  # default: vm where the probe shows it works
    try:
        assert eng.copy_strategy == ("vm" if shm_copy.vm_works() else "memmove")
    finally:
        eng.close()
    eng = ShmTransferEngine(BackendContext(env={"PDCORE_SHM_COPY": "memmove"}))
    try:
        assert eng.copy_strategy == "memmove"
    finally:
        eng.close()


def test_deregister_waits_for_running_copy_and_cancels_queued_ones() -> None:
    """deregister() waits for a copy that is reading local memory; a batch still queued when
    it returns never reads the deregistered memory (it fails instead)."""
    import threading

    src = np.ones(1 << 20, dtype=np.uint8)
    pool = ShmMemoryPool(PoolContext(server_id="shmtest-dereg"))
    eng = ShmTransferEngine(BackendContext(thread_pool_size=1))
    other = ShmTransferEngine(BackendContext(server_id="shmtest-dereg"))
    gate = threading.Event()
    try:
        dst = pool.allocate("dst", (1 << 20,), torch.uint8)
        region = MemoryRegion(src.ctypes.data, src.nbytes)
        eng.register([region])
        peer = eng.connect(other.endpoint(), [dst.region])
        # 1. a copy "in progress" holds the shared side: deregister must wait for it
        assert eng._local_guard.acquire_shared(1)
        done = threading.Event()
        t = threading.Thread(target=lambda: (eng.deregister([region]), done.set()))
        t.start()
        assert not done.wait(0.3), "deregister returned while a copy was still reading"
        eng._local_guard.release_shared()
        assert done.wait(10)
        t.join(10)
        # 2. a batch queued before a deregister is refused when its turn comes
        eng.register([region])
        eng._pool.submit(gate.wait, 10)  # the only worker is busy: the next write queues
        queued = eng.write(peer, batch([src.ctypes.data], [dst.region.addr], [4096]))
        eng.deregister([region])
        gate.set()
        res = eng.wait(queued, 10)
        assert res.status is TransferStatus.FAILED and "deregistered" in res.reason
        assert not dst.tensor.any()
    finally:
        gate.set()
        eng.close()
        other.close()
        pool.close()


@pytest.mark.parametrize("strategy", ["vm", "memmove"])
def test_copy_strategies_move_shuffled_items_across_system_calls(strategy: str) -> None:
    """One batch of more than IOV_MAX items, destinations in shuffled order (as write() hands
    them over after sorting its own way): every item lands in its own slot."""
    if strategy == "vm" and not shm_copy.vm_works():
        pytest.skip("process_vm_writev is forbidden here")
    name, copy = shm_copy.pick(strategy)
    assert name == strategy
    n, item = shm_copy.IOV_MAX + 300, 48
    src = np.random.default_rng(0).integers(0, 256, n * item, dtype=np.uint8)
    dst = np.zeros(n * item, dtype=np.uint8)
    slots = np.random.default_rng(1).permutation(n).astype(np.uint64)
    at = np.arange(n, dtype=np.uint64) * np.uint64(item)
    local, remote = shm_copy.iovecs(np.uint64(dst.ctypes.data) + slots * np.uint64(item),
                                    np.uint64(src.ctypes.data) + at,
                                    np.full(n, item, dtype=np.uint64))
    copy(local, remote)
    assert (dst.reshape(n, item)[slots.astype(np.int64)] == src.reshape(n, item)).all()


def test_copy_failures_are_os_errors_not_crashes() -> None:
    if not shm_copy.vm_works():
        pytest.skip("process_vm_writev is forbidden here")
    src = np.ones(64, dtype=np.uint8)
    local, remote = shm_copy.iovecs(np.array([16], dtype=np.uint64),  # nothing is mapped there
                                    np.array([src.ctypes.data], dtype=np.uint64),
                                    np.array([64], dtype=np.uint64))
    with pytest.raises(OSError, match="copied"):
        shm_copy.writev(local, remote)
    with pytest.raises(OSError, match="only within this process"):
        shm_copy.memmove_iov(local, remote, pid=1)
