"""The backend kit (pdcore.backendkit) on its own: real threads, real numpy lookups."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pdcore.backendkit import (
    HandleTable,
    RegionIndex,
    ShardedWorkers,
    TransferJobs,
    host_port,
)
from pdcore.errors import TransferError
from pdcore.interfaces.transfer import (
    DONE,
    PENDING,
    MemoryRegion,
    PollResult,
    TransferStatus,
    failed,
)


def test_sharded_workers_keep_each_key_in_order_and_report_results() -> None:
    seen: dict[str, list[int]] = {"a": [], "b": []}
    workers = ShardedWorkers(num_queues=2, num_threads=4,
                             handler=lambda item: seen[item[0]].append(item[1]) or item[1])
    workers.start()
    try:
        futs = [workers.submit(k, (k, i)) for i in range(40) for k in ("a", "b")]
        assert [f.result(timeout=10) for f in futs] == [i for i in range(40) for _ in "ab"]
        assert seen == {"a": list(range(40)), "b": list(range(40))}
        assert workers.unfinished() == 0 and workers.pending() == 0
    finally:
        workers.close()
    assert not any(t.is_alive() for t in workers.threads)


def test_sharded_workers_a_stuck_peer_stalls_no_other_peer() -> None:
    """Two peers whose keys hash to the same queue (crc32 % 2 of both is 1): a transfer stuck on
    one (a partitioned decode server, up to the transfer timeout) must not hold the other's
    jobs behind it while a queue is idle (#49: a P-D partition stalled every D for 30 s)."""
    gate, started = threading.Event(), threading.Event()

    def handler(item: tuple[str, int]) -> int:
        if item[0] == "peer-0":
            started.set()
            gate.wait(30)
        return item[1]

    workers = ShardedWorkers(num_queues=2, num_threads=2, handler=handler)
    workers.start()
    try:
        stuck = workers.submit("peer-0", ("peer-0", 0))
        assert started.wait(10)
        others = [workers.submit("peer-1", ("peer-1", i)) for i in range(3)]
        assert [f.result(timeout=5) for f in others] == [0, 1, 2]
        queued = workers.submit("peer-0", ("peer-0", 1))  # behind its own stuck job, in order
        assert not queued.done() and workers.pending() == 1
        gate.set()
        assert stuck.result(timeout=10) == 0 and queued.result(timeout=10) == 1
        assert workers.unfinished() == 0
    finally:
        gate.set()
        workers.close()


def test_sharded_workers_close_hands_back_what_never_ran() -> None:
    gate, started = threading.Event(), threading.Event()
    workers = ShardedWorkers(num_queues=1, num_threads=1,
                             handler=lambda item: started.set() or gate.wait(10))
    workers.start()
    running = workers.submit("k", "first")
    assert started.wait(10)  # the one thread is busy with it: what follows stays queued
    queued = [workers.submit("k", f"later-{i}") for i in range(3)]
    assert workers.unfinished() == 4
    threading.Timer(0.05, gate.set).start()
    leftovers = workers.close(timeout=10)
    assert running.result(timeout=10) is True
    assert leftovers == ["later-0", "later-1", "later-2"]
    assert all(f.cancelled() for f in queued) and workers.unfinished() == 0
    with pytest.raises(TransferError, match="closed"):
        workers.submit("k", "too late")
    assert workers.close() == []  # idempotent


def test_a_raising_job_fails_its_future_and_the_thread_survives() -> None:
    def handler(item: str) -> str:
        if item == "boom":
            raise RuntimeError("library exploded")
        return item

    workers = ShardedWorkers(1, 1, handler=handler)
    workers.start()
    try:
        with pytest.raises(RuntimeError, match="library exploded"):
            workers.submit("k", "boom").result(timeout=10)
        assert workers.submit("k", "fine").result(timeout=10) == "fine"
    finally:
        workers.close()


class _Tracked:
    """A job its library tracks: PENDING until the test says otherwise."""

    def __init__(self) -> None:
        self.result: PollResult = PENDING
        self.polls = 0

    def poll(self) -> PollResult:
        self.polls += 1
        return self.result


def test_handle_table_polls_tracked_jobs_and_releases_them_once_final() -> None:
    table = HandleTable("kit")
    job = _Tracked()
    h = table.add(job)
    assert table.poll(h).status is TransferStatus.PENDING
    r = table.wait(h, 0.05)
    assert r.status is TransferStatus.FAILED and "timed out" in r.reason
    job.result = failed("peer gone")
    assert table.wait(h, 10) == failed("peer gone")
    again = table.poll(h)
    assert again.status is TransferStatus.FAILED and f"unknown handle {h}" in again.reason
    assert job.polls >= 3


def test_handle_table_reads_job_results_and_drain_forgets_everything() -> None:
    jobs = TransferJobs("kit", thread_pool_size=2, queue_size=2)
    try:
        done = jobs.submit("p", lambda: None)
        refused = jobs.submit("p", lambda: "peer refused")
        final = jobs.submit("q", lambda: failed("as a PollResult"))
        assert jobs.wait(done, 10) is DONE
        assert jobs.wait(refused, 10) == failed("peer refused")
        assert jobs.wait(final, 10) == failed("as a PollResult")
        settled = jobs.finished("empty batch refused")
        assert jobs.poll(settled) == failed("empty batch refused")
        left = jobs.finished()
    finally:
        jobs.close()
    r = jobs.poll(left)  # close() forgot it
    assert r.status is TransferStatus.FAILED and f"unknown handle {left}" in r.reason


def test_region_index_bounds_positions_and_reasons() -> None:
    index = RegionIndex([MemoryRegion(0x2000, 0x100), MemoryRegion(0x1000, 0x100)])
    addr = np.array([0x1000, 0x10F0, 0x2080, 0x1100, 0x0FFF], dtype=np.uint64)
    length = np.array([0x100, 0x10, 0x80, 0, 1], dtype=np.uint64)
    idx, ok = index.locate(addr, length)
    assert ok.tolist() == [True, True, True, True, False]
    assert idx[:3].tolist() == [0, 0, 1]
    assert index.position(np.array([0x0, 0x1050, 0x2050, 0x9000], dtype=np.uint64)).tolist() \
        == [0, 0, 1, 1]
    assert index.contains(addr[:4], length[:4]) and not index.contains(addr, length)
    _, bad = index.outside("dst", addr, length)
    assert bad == "dst item 4 [0xfff, +1 bytes)"
    # one byte past a region, and a length that would wrap a 64-bit address, are refused
    past = np.array([0x10F0, 0x1000], dtype=np.uint64)
    assert not index.locate(past, np.array([0x11, 2**64 - 0x800], dtype=np.uint64))[1].any()
    assert RegionIndex([]).contains(np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    assert not RegionIndex([]).contains(addr[:1], length[:1])


def test_host_port_endpoints() -> None:
    assert host_port(b"10.0.0.2:4242", "mine") == "10.0.0.2:4242"
    assert host_port(b"[::1]:80", "mine") == "[::1]:80"
    for bad in (b"10.0.0.2", b":80", b"h:0", b"h:65536", b"h:x", b"\xff:1"):
        with pytest.raises(TransferError, match="mine peer endpoint .* is not 'host:port'"):
            host_port(bad, "mine")
