"""Transfer jobs: blocking library calls on sharded worker threads, reported through handles.

For a backend whose library call blocks until its copies land (or fail): write() submits a job
keyed by the peer and returns a handle; the job returns None when done, a reason string when
not (or a PollResult); poll()/wait() follow the TransferEngine contract (HandleTable).
"""

from __future__ import annotations

from collections.abc import Callable

from pdcore.backendkit.handles import HandleTable
from pdcore.backendkit.workers import ShardedWorkers
from pdcore.interfaces.transfer import DONE, PollResult, failed

Job = Callable[[], "str | PollResult | None"]


class TransferJobs:
    def __init__(self, owner: str, thread_pool_size: int, queue_size: int = 1,
                 label: str = "") -> None:
        self.workers = ShardedWorkers(queue_size, thread_pool_size, label=label or f"pd-{owner}")
        self.handles = HandleTable(owner)
        self.workers.start()

    @property
    def threads(self) -> list:
        return self.workers.threads

    @property
    def queue_size(self) -> int:
        return self.workers.num_queues

    @property
    def threads_per_queue(self) -> int:
        return self.workers.threads_per_queue

    def submit(self, key: str, job: Job) -> int:
        """Run job() behind the earlier jobs for `key`; TransferError once closed."""
        return self.handles.add(self.workers.submit(key, job))

    def finished(self, reason: str | None = None) -> int:
        """A handle that is already DONE (reason None) or FAILED (reason)."""
        return self.handles.add(DONE if reason is None else failed(reason))

    def poll(self, handle: int) -> PollResult:
        return self.handles.poll(handle)

    def wait(self, handle: int, timeout: float) -> PollResult:
        return self.handles.wait(handle, timeout)

    def pending(self) -> int:
        """Jobs not finished yet (queued or running)."""
        return self.workers.unfinished()

    def close(self, join_timeout: float | None = 2.0) -> None:
        """Cancel the jobs that never ran, stop the threads (bounded join, see ShardedWorkers)
        and forget every handle: polling one afterwards is FAILED 'unknown handle'."""
        self.workers.close(join_timeout)
        self.handles.drain()
