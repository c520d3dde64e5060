"""P's transfer workers are the backend kit's sharded workers.

`SGLANG_DISAGGREGATION_QUEUE_SIZE` queues share `SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`
threads (pool // queues each, at least one). All work for one decode session lands in the same
queue, and a session with work in flight gets a queue no other busy session holds while there is
one, so a dead or slow decode stalls only itself while the other sessions keep moving.
This module only names them for the prefill KV manager (pdcore.backendkit.workers has the code).
"""

from __future__ import annotations

from pdcore.backendkit.workers import ShardedWorkers

__all__ = ["ShardedWorkers"]
