"""pd-mooncake engine behaviour against the real library (in this process, over TCP on lo)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) not installed")

from pd_mooncake.engine import MooncakeEngine

from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.memory import PoolContext
from pdcore.interfaces.transfer import (
    BackendContext,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    TransferStatus,
)
from pdcore.plugins.host import memory_pools
from pdcore.testing.processes import free_port


def engine(env: dict[str, str] | None = None, **ctx: object) -> MooncakeEngine:
    return MooncakeEngine(BackendContext(host="127.0.0.1", env=env or {}, **ctx))  # type: ignore[arg-type]


def region(buf: np.ndarray, kind: MemoryKind = MemoryKind.HOST) -> MemoryRegion:
    return MemoryRegion(addr=buf.ctypes.data, length=buf.nbytes, kind=kind)


@pytest.fixture
def pair() -> Iterator[tuple[MooncakeEngine, MooncakeEngine]]:
    a = engine({"MOONCAKE_PROTOCOL": "tcp", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "256",
                "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "256"},
               thread_pool_size=4, queue_size=2)
    b = engine({"MOONCAKE_PROTOCOL": "tcp"})
    yield a, b
    a.close()
    b.close()


def wait(e: MooncakeEngine, handle: int, timeout: float = 30.0):
    return e.wait(handle, timeout)


def test_rdma_without_nic_reports_the_tcp_fallback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pd_mooncake")
    e = engine()  # MOONCAKE_PROTOCOL unset: rdma, as in SGLang
    try:
        assert e.settings.protocol == "rdma"
        assert e.transport == "tcp"
        assert e.fallback_warning and "silently fell back to TCP" in caplog.text
        assert e.describe()["transport"] == "tcp"
        assert e.endpoint() == f"127.0.0.1:{e.rpc_port}".encode()
    finally:
        e.close()


def test_force_hca_without_nic_fails_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_FORCE_HCA", "1")  # the library reads its own environment
    with pytest.raises(ConfigError, match="MC_FORCE_HCA is set, so Mooncake refused to fall back"):
        engine({"MC_FORCE_HCA": "1"})


def test_custom_pool_that_cannot_be_honoured_stops_start_up() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the pool may be honoured (see the gpu tests)")
    with pytest.raises(ConfigError, match="SGLANG_MOONCAKE_CUSTOM_MEM_POOL=NVLINK cannot be "
                                          "honoured: it needs a CUDA GPU"):
        engine({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "True", "MC_FORCE_MNNVL": "1"})


def test_sub_batches_and_thread_pool(pair: tuple[MooncakeEngine, MooncakeEngine]) -> None:
    a, b = pair
    d = a.describe()
    assert (d["sub_batch"], d["inflight_per_peer"], d["threads"], d["queues"]) == (256, 512, 4, 2)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros(4 << 20, dtype=np.uint8)
    a.register([region(src)])
    b.register([region(dst)])
    peer = a.connect(b.endpoint(), [region(dst)])
    pages = rng.permutation(1024)[:900].astype(np.uint64)  # 900 scattered 4 KiB pages: 4 sub-batches
    batch = CopyBatch(src.ctypes.data + pages * 4096, dst.ctypes.data + pages[::-1] * 4096,
                      np.full(len(pages), 4096, dtype=np.uint64))
    # same peer, two threads on its queue: each wants two sub-batches in flight, the budget
    # holds two in all, so a thread that cannot take its second one at once settles its first
    handles = [a.write(peer, batch) for _ in range(3)]
    for h in handles:
        r = wait(a, h)
        assert r.status is TransferStatus.DONE, r.reason
    for s, t in zip(pages.tolist(), pages[::-1].tolist(), strict=True):
        assert np.array_equal(dst[t * 4096:(t + 1) * 4096], src[s * 4096:(s + 1) * 4096])


def test_destination_outside_the_peer_region_fails_with_a_reason(
        pair: tuple[MooncakeEngine, MooncakeEngine]) -> None:
    a, b = pair
    src = np.ones(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    a.register([region(src)])
    b.register([region(dst)])
    peer = a.connect(b.endpoint(), [region(dst)])
    bad = CopyBatch(np.array([src.ctypes.data], np.uint64),
                    np.array([dst.ctypes.data + dst.nbytes - 100], np.uint64),
                    np.array([4096], np.uint64))
    r = wait(a, a.write(peer, bad))
    assert r.status is TransferStatus.FAILED
    assert peer.key in r.reason and "refused the batch" in r.reason
    assert not dst.any()
    ok = CopyBatch(np.array([src.ctypes.data], np.uint64), np.array([dst.ctypes.data], np.uint64),
                   np.array([4096], np.uint64))
    assert wait(a, a.write(peer, ok)).status is TransferStatus.DONE  # the peer is still usable
    assert dst[:4096].all() and not dst[4096:].any()


def test_connect_errors(pair: tuple[MooncakeEngine, MooncakeEngine]) -> None:
    a, _ = pair
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="cannot reach mooncake peer 127.0.0.1:"):
        a.connect(f"127.0.0.1:{free_port()}".encode(), [])
    assert time.monotonic() - t0 < 5
    for bad in (b"127.0.0.1", b"127.0.0.1:http", b":80", b"\xff\xfe"):
        with pytest.raises(TransferError, match="is not 'host:port'"):
            a.connect(bad, [])


def test_memory_kinds(pair: tuple[MooncakeEngine, MooncakeEngine]) -> None:
    a, _ = pair
    buf = np.zeros(4096, dtype=np.uint8)
    if MemoryKind.CUDA not in a.capabilities.memory_kinds:
        with pytest.raises(TransferError, match="cannot register cuda memory"):
            a.register([region(buf, MemoryKind.CUDA)])
    with pytest.raises(TransferError, match="cannot register npu memory"):
        a.register([region(buf, MemoryKind.NPU)])
    a.register([region(buf)])
    a.register([region(buf)])  # registering the same region twice is a no-op
    a.deregister([region(buf)])


def test_closed_engine_refuses_work() -> None:
    e = engine({"MOONCAKE_PROTOCOL": "tcp"})
    e.close()
    e.close()
    with pytest.raises(TransferError, match="closed"):
        e.endpoint()
    with pytest.raises(TransferError, match="closed"):
        e.write(None, CopyBatch.empty())  # type: ignore[arg-type]


def test_shared_memory_pool_regions() -> None:
    """The core's `shm` pool (decode KV in named shared memory) registers like host memory."""
    import torch

    pool_a = memory_pools().create("shm", PoolContext(server_id="mc-test-a"))
    pool_b = memory_pools().create("shm", PoolContext(server_id="mc-test-b"))
    a = engine({"MOONCAKE_PROTOCOL": "tcp"})
    b = engine({"MOONCAKE_PROTOCOL": "tcp"})
    try:
        src = pool_a.allocate("k", (1 << 20,), torch.uint8)
        dst = pool_b.allocate("k", (1 << 20,), torch.uint8)
        assert dst.region.kind is MemoryKind.SHM
        src.tensor.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
        a.register([src.region])
        b.register([dst.region])
        peer = a.connect(b.endpoint(), [dst.region])
        batch = CopyBatch(np.array([src.region.addr], np.uint64),
                          np.array([dst.region.addr + 4096], np.uint64),
                          np.array([65536], np.uint64))
        assert wait(a, a.write(peer, batch)).status is TransferStatus.DONE
        assert torch.equal(dst.tensor[4096:4096 + 65536], src.tensor[:65536])
        assert not dst.tensor[:4096].any()
    finally:
        a.close()
        b.close()
        pool_a.close()
        pool_b.close()


class ScriptedLibrary:
    """Stands in for mooncake's TransferEngine inside `_send`: records the call order and fails
    the batch ids it is told to."""

    def __init__(self, failing: frozenset[int] = frozenset()) -> None:
        self.calls: list[str] = []
        self.failing = failing
        self.next_id = 0

    def batch_transfer_async_write(self, target: str, src: list[int], dst: list[int],
                                   length: list[int]) -> int:
        self.next_id += 1
        self.calls.append(f"submit{self.next_id}:{len(src)}")
        return self.next_id

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        self.calls.append(f"wait{ids[0]}")
        return -1 if ids[0] in self.failing else 0

    def send_probe(self, target: str) -> int:
        return 0


def scripted_send(lib: ScriptedLibrary, requests: int, env: dict[str, str]) -> tuple[str | None, MooncakeEngine]:
    from pd_mooncake.settings import MooncakeSettings
    from pd_mooncake.workers import InflightBudget

    e = object.__new__(MooncakeEngine)  # only what _send touches: settings and the budget
    e.settings = MooncakeSettings.from_context(BackendContext(host="127.0.0.1", env=env))
    e._budget = InflightBudget(e.settings.inflight_per_peer)
    ones = np.ones(requests, dtype=np.uint64)
    return e._send(lib, "peer:1", CopyBatch(ones, ones, ones)), e


@pytest.mark.parametrize(("pending", "calls"), [
    # room for two: the next sub-batch is submitted before the current one is waited for
    ("100", ["submit1:100", "submit2:100", "wait1", "submit3:50", "wait2", "wait3"]),
    # budget = one sub-batch (pending admissions 1): never two in flight
    ("1", ["submit1:100", "wait1", "submit2:100", "wait2", "submit3:50", "wait3"]),
])
def test_sub_batches_in_flight_follow_the_budget_and_it_comes_back(pending: str,
                                                                    calls: list[str]) -> None:
    lib = ScriptedLibrary()
    env = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "100",
           "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": pending}
    reason, e = scripted_send(lib, 250, env)
    assert reason is None
    assert lib.calls == calls
    assert e._budget.in_flight("peer:1") == 0


def test_a_failed_sub_batch_waits_out_the_other_and_frees_the_budget() -> None:
    lib = ScriptedLibrary(failing={1})
    env = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "100", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "100"}
    reason, e = scripted_send(lib, 250, env)
    assert reason is not None and "requests 0..99 of 250" in reason
    assert lib.calls == ["submit1:100", "submit2:100", "wait1", "wait2"]  # nothing after the failure
    assert e._budget.in_flight("peer:1") == 0
