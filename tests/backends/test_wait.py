"""TransferEngine.wait(), which the core's sender blocks in: the polling default and the
completion-woken HandleTable version of the built-in engines. Both return DONE / FAILED as poll()
would, and after their timeout FAILED 'timed out' while the handle stays pending."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from pdcore.backendkit import HandleTable
from pdcore.interfaces.transfer import (
    DONE,
    PENDING,
    Capabilities,
    CopyBatch,
    Peer,
    PollResult,
    TransferEngine,
    TransferStatus,
    failed,
)


class _PollOnly(TransferEngine):
    """Handles finish when the test says so; only poll() is implemented (the default wait)."""

    name = "poll-only"
    capabilities = Capabilities()

    def __init__(self) -> None:
        self.results: dict[int, PollResult] = {}
        self.polls = 0

    def register(self, regions) -> None:
        pass

    def endpoint(self) -> bytes:
        return b""

    def connect(self, peer_endpoint: bytes, peer_regions) -> Peer:
        return Peer(endpoint=peer_endpoint, key="p", state=None)

    def write(self, peer: Peer, batch: CopyBatch) -> int:
        h = len(self.results) + 1
        self.results[h] = PENDING
        return h

    def poll(self, handle: int) -> PollResult:
        self.polls += 1
        r = self.results[handle]
        if r.status is not TransferStatus.PENDING:
            del self.results[handle]
        return r

    def close(self) -> None:
        pass


def test_default_wait_returns_the_result_and_times_out_leaving_the_handle_pending() -> None:
    eng = _PollOnly()
    h = eng.write(eng.connect(b"", []), CopyBatch.empty())
    r = eng.wait(h, 0.05)
    assert r.status is TransferStatus.FAILED and "timed out" in (r.reason or "")
    assert eng.poll(h).status is TransferStatus.PENDING  # still there
    threading.Timer(0.05, lambda: eng.results.__setitem__(h, failed("peer gone"))).start()
    r = eng.wait(h, 10)
    assert r.status is TransferStatus.FAILED and r.reason == "peer gone"
    assert eng.polls > 2  # it polled until the result came


def test_handle_table_wait_wakes_on_completion_and_keeps_poll_semantics() -> None:
    table = HandleTable("t")
    fut: Future = Future()
    h = table.add(fut)
    r = table.wait(h, 0.05)
    assert r.status is TransferStatus.FAILED and "t: timed out" in (r.reason or "")
    assert table.poll(h).status is TransferStatus.PENDING
    threading.Timer(0.05, fut.set_result, args=(DONE,)).start()
    assert table.wait(h, 10).status is TransferStatus.DONE
    # released like poll() releases it
    assert "unknown handle" in (table.wait(h, 1).reason or "")
    # a failed job and an already-final result
    bad: Future = Future()
    bad.set_exception(RuntimeError("copy broke"))
    assert "copy broke" in (table.wait(table.add(bad), 1).reason or "")
    assert table.wait(table.add(failed("no peer")), 1).reason == "no peer"
