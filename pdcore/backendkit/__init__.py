"""Backend kit: the pieces every transfer backend needs, public for third-party plugins.

- `HandleTable` (handles.py): integer handles with the poll()/wait() contract, unknown handle
  included;
- `RegionIndex` (regions.py): vectorised "which registered region holds this address" and
  bounds checks, plus `batch_arrays`, `describe_range`, `region_views`;
- `ShardedWorkers` (workers.py): FIFO queues by peer key served by a fixed set of threads;
- `TransferJobs` (jobs.py): blocking library calls on sharded workers behind handles;
- `HandleEngine` (engine.py): a TransferEngine base answering poll()/wait() from a HandleTable;
- `host_port` (endpoints.py): a "host:port" peer endpoint, validated;
- `split_by_bytes`, `join_futures` (parallel.py): one batch over several copy workers;
- `SharedExclusive` (guard.py): never unmap memory a copy still uses;
- `read_timeout` (settings.py): a validated PDCORE_*_TIMEOUT style setting.
It imports only pdcore.interfaces and pdcore.errors (and numpy). See docs/backend-kit.md.
"""

from __future__ import annotations

from pdcore.backendkit.endpoints import host_port
from pdcore.backendkit.engine import HandleEngine
from pdcore.backendkit.guard import SharedExclusive
from pdcore.backendkit.handles import HandleTable
from pdcore.backendkit.jobs import TransferJobs
from pdcore.backendkit.parallel import join_futures, split_by_bytes
from pdcore.backendkit.regions import (
                                       MAX_ITEM_BYTES,
                                       RegionIndex,
                                       batch_arrays,
                                       describe_range,
                                       region_views,
)
from pdcore.backendkit.settings import read_timeout
from pdcore.backendkit.workers import ShardedWorkers

__all__ = [
    "MAX_ITEM_BYTES",
    "HandleEngine",
    "HandleTable",
    "RegionIndex",
    "ShardedWorkers",
    "SharedExclusive",
    "TransferJobs",
    "batch_arrays",
    "describe_range",
    "host_port",
    "join_futures",
    "read_timeout",
    "region_views",
    "split_by_bytes",
]
