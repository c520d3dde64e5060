"""`fake` transfer engine: moves nothing and reports success at once.

For warm-up and for benchmarking the rest of the PD path without paying for data movement.
Capabilities say `moves_data=False`, so callers (tests, the core) know the destination bytes
are not touched. It still keeps its contract: handles are released by poll(), unknown handles
fail, and a closed engine refuses work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from pdcore.backendkit import HandleEngine, HandleTable
from pdcore.interfaces.transfer import (
    DONE,
    BackendContext,
    Capabilities,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    Peer,
)


class FakeTransferEngine(HandleEngine):
    name = "fake"
    capabilities = Capabilities(
        memory_kinds=frozenset(MemoryKind),
        needs_metadata=False,
        moves_data=False,
    )

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self._regions: list[MemoryRegion] = []
        self.handles = HandleTable("fake")
        self._closed = False
        self.batches = 0  # counters, handy for tests and benchmarks of the rest of the path
        self.bytes_reported = 0

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        self._regions.extend(regions)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        gone = set(regions)
        self._regions = [r for r in self._regions if r not in gone]

    def endpoint(self) -> bytes:
        return json.dumps({"backend": "fake", "server_id": self.ctx.server_id,
                           "rank": self.ctx.rank, "pid": os.getpid()}).encode()

    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        self._check_open()
        return Peer(endpoint=bytes(peer_endpoint), key=f"fake:{bytes(peer_endpoint)[:64]!r}")

    def write(self, peer: Peer, batch: CopyBatch) -> int:
        self._check_open()
        self.batches += 1
        self.bytes_reported += batch.nbytes
        return self.handles.add(DONE)

    def close(self) -> None:
        self._closed = True
