"""Transfer workers and the per-peer in-flight budget, with real threads (no SDK needed)."""

from __future__ import annotations

import threading
import time

import pytest
from pd_mooncake.workers import InflightBudget, TransferWorkers

from pdcore.errors import TransferError
from pdcore.interfaces.transfer import TransferStatus


def wait(workers: TransferWorkers, handle: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        r = workers.poll(handle)
        if r.status is not TransferStatus.PENDING or time.monotonic() > deadline:
            return r
        time.sleep(0.001)


def assert_unknown(r, handle: int) -> None:
    """The transfer contract: an unknown handle is FAILED naming it, never an exception."""
    assert r.status is TransferStatus.FAILED and f"unknown handle {handle}" in r.reason


def test_threads_per_queue_follow_pool_and_queue_sizes() -> None:
    w = TransferWorkers(thread_pool_size=6, queue_size=2)
    try:
        assert len(w.threads) == 6 and w.threads_per_queue == 3
        assert min(t.name for t in w.threads) == "pd-mooncake-q0-w0"
        assert all(t.is_alive() for t in w.threads)
    finally:
        w.close()
    assert not any(t.is_alive() for t in w.threads)
    w = TransferWorkers(thread_pool_size=2, queue_size=4)  # at least one thread per queue
    w.close()
    assert len(w.threads) == 4


def test_one_peer_keeps_its_order_and_results_are_reported() -> None:
    w = TransferWorkers(thread_pool_size=4, queue_size=4)
    order: list[int] = []
    try:
        handles = [w.submit("127.0.0.1:1000", lambda i=i: order.append(i)) for i in range(50)]
        failing = w.submit("127.0.0.1:2000", lambda: "peer refused")
        assert all(wait(w, h).status is TransferStatus.DONE for h in handles)
        r = wait(w, failing)
        assert r.status is TransferStatus.FAILED and r.reason == "peer refused"
        assert order == list(range(50))
        assert_unknown(w.poll(handles[0]), handles[0])  # DONE released it
    finally:
        w.close()


def test_a_raising_job_fails_its_handle_and_the_worker_survives() -> None:
    w = TransferWorkers(thread_pool_size=1, queue_size=1)
    try:
        def boom() -> None:
            raise RuntimeError("library exploded")
        r = wait(w, w.submit("p", boom))
        assert r.status is TransferStatus.FAILED and "RuntimeError: library exploded" in r.reason
        assert wait(w, w.submit("p", lambda: None)).status is TransferStatus.DONE
    finally:
        w.close()


def test_finished_handles_and_close() -> None:
    w = TransferWorkers(thread_pool_size=1, queue_size=1)
    assert w.poll(w.finished()).status is TransferStatus.DONE
    gate = threading.Event()
    blocked = w.submit("p", lambda: None if gate.wait(5) else "gate")
    queued = w.submit("p", lambda: None)
    assert w.poll(blocked).status is TransferStatus.PENDING and w.pending() == 2
    gate.set()
    w.close()
    with pytest.raises(TransferError, match="closed"):
        w.submit("p", lambda: None)
    assert_unknown(w.poll(queued), queued)


def test_budget_bounds_requests_in_flight_per_peer() -> None:
    budget = InflightBudget(limit=100)
    peak = {"a": 0, "b": 0}
    lock = threading.Lock()

    def job(peer: str, n: int) -> str | None:
        if not budget.acquire(peer, n, timeout=5):
            return "no room"
        try:
            with lock:
                peak[peer] = max(peak[peer], budget.in_flight(peer))
            time.sleep(0.01)
        finally:
            budget.release(peer, n)
        return None

    w = TransferWorkers(thread_pool_size=8, queue_size=1)  # 8 threads share one queue
    try:
        handles = [w.submit("q", lambda p=p: job(p, 40)) for p in ("a", "b") * 8]
        assert all(wait(w, h).status is TransferStatus.DONE for h in handles)
    finally:
        w.close()
    assert 40 <= peak["a"] <= 100 and 40 <= peak["b"] <= 100
    assert budget.in_flight("a") == budget.in_flight("b") == 0


def test_budget_times_out_when_full() -> None:
    budget = InflightBudget(limit=10)
    assert budget.acquire("a", 10, timeout=1)
    t0 = time.monotonic()
    assert not budget.acquire("a", 1, timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 2
    assert budget.acquire("b", 10, timeout=0.1)  # other peers are independent
    budget.release("a", 10)
    assert budget.acquire("a", 5, timeout=0.1)


def test_wait_wakes_on_the_task_and_times_out_leaving_it_pending() -> None:
    w = TransferWorkers(thread_pool_size=1, queue_size=1)
    gate = threading.Event()
    try:
        h = w.submit("p", lambda: None if gate.wait(5) else "gate")
        r = w.wait(h, 0.05)
        assert r.status is TransferStatus.FAILED and "timed out" in r.reason
        assert w.poll(h).status is TransferStatus.PENDING  # still running, still ours
        threading.Timer(0.05, gate.set).start()
        assert w.wait(h, 10).status is TransferStatus.DONE
        r = w.wait(w.submit("p", lambda: "peer refused"), 10)
        assert r.status is TransferStatus.FAILED and r.reason == "peer refused"
        assert_unknown(w.wait(h, 1), h)  # DONE released it, as poll() does
    finally:
        gate.set()
        w.close()
