"""Core side of staged transfers: how the KV managers use a StagingPlanner (pd-staging).

The planner plugin owns the memory and the copies (P buffers, D ring, gather, scatter); the core
owns the protocol and every safety check:

1. start-up: when the configured planner is a StagingPlanner, each manager opens its staging
   memory (P: per-worker buffers, D: the ring) and registers it with the backend together with
   the KV and aux regions; D announces its ring in Register;
2. D, per room whose P runs another TP size: `GrantBook.reserve` takes a grant of the ring
   (FIFO; a room waits, its TransferInfo held back, while the ring is full; a room that can never
   fit fails) and sends it in TransferInfo;
3. P, per chunk and D rank: `chunk_batch` gathers the chunk into a buffer and yields ONE copy into
   the grant (bounds-checked against the grant), or falls back to the planner's page/slice copies
   when the pair is not staged (equal TP, or one side without staging);
4. P's Success carries `staged`; D scatters the grant into its pages only when every writer
   staged, then frees the grant. Flow control: a grant belongs to one room until D scattered it;
   a failed room's grant is quarantined before reuse, so a late write never lands in another
   room's data.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from pdcore.config import DisaggEnv
from pdcore.interfaces.planner import (
    DecodeStaging,
    KVLayout,
    PrefillStaging,
    StagingContext,
    StagingPlanner,
    TransferPlanner,
)
from pdcore.interfaces.transfer import CopyBatch

log = logging.getLogger(__name__)

QUARANTINE_S = 5.0  # as for D's pages: late writes of a failed room land in a held grant


def open_staging(planner: TransferPlanner, role: str, layout: KVLayout,
                 kv: Sequence[tuple[Any, Any]] | None, pool: Any, env: DisaggEnv
                 ) -> PrefillStaging | DecodeStaging | None:
    """Staging memory for this manager, or None (no staging planner, or no KV tensors)."""
    if not isinstance(planner, StagingPlanner) or kv is None or pool is None:
        return None
    ctx = StagingContext(layout=layout, kv=kv, pool=pool,
                         buffer_bytes=env.staging_buffer_size_mb << 20,
                         ring_bytes=env.staging_pool_size_mb << 20,
                         workers=max(env.thread_pool_size, env.queue_size))
    return planner.open_prefill(ctx) if role == "prefill" else planner.open_decode(ctx)


@contextmanager
def chunk_batch(planner: TransferPlanner, staging: PrefillStaging | None, src: KVLayout,
                sess: Any, dest: Any, src_pages: np.ndarray, *, page_start: int
                ) -> Iterator[tuple[CopyBatch, bool]]:
    """(copies of one chunk into one D rank, whether they go through D's staging grant)."""
    if (staging is not None and dest.grant_len > 0 and sess.staging is not None
            and isinstance(planner, StagingPlanner) and planner.staged(src, sess.layout)):
        skip = dest.prefix_pages  # the grant covers only the pages D does not hold already
        with staging.stage(sess.layout, src_pages, page_start - skip, len(dest.pages) - skip,
                           sess.staging.addr + dest.grant_off, dest.grant_len) as batch:
            sess.check_grant_batch(batch, dest.grant_off, dest.grant_len)
            yield batch, True
        return
    dst = dest.pages[page_start: page_start + len(src_pages)]
    batch = planner.plan(src, sess.layout, src_pages, dst)
    sess.check_kv_batch(batch)
    yield batch, False


class GrantBook:
    """D's grants of its staging ring: reserve (FIFO waiters), free, quarantine. Thread-safe."""

    def __init__(self, staging: DecodeStaging) -> None:
        self.staging = staging
        self._lock = threading.Lock()
        self._waiting: OrderedDict[int, int] = OrderedDict()  # room -> bytes, FIFO
        self._held: list[tuple[float, int]] = []  # (release time, offset)
        self.granted = 0
        self.waited = 0

    def too_big(self, nbytes: int) -> str:
        size = self.staging.region.length
        if nbytes > size:
            return (f"the room needs {nbytes / 2**20:.1f} MiB of decode's staging ring, which "
                    f"has {size / 2**20:.1f} MiB; raise SGLANG_DISAGG_STAGING_POOL_SIZE_MB")
        return ""

    def reserve(self, room: int, nbytes: int) -> int | None:
        """An offset now, or None: the room waits (FIFO) until `ready()` returns it."""
        with self._lock:
            if not self._waiting:
                off = self.staging.reserve(nbytes)
                if off is not None:
                    self.granted += 1
                    return off
            self._waiting[room] = nbytes
            self.waited += 1
            return None

    def cancel(self, room: int) -> None:
        with self._lock:
            self._waiting.pop(room, None)

    def ready(self, now: float) -> list[tuple[int, int, int]]:
        """Release quarantined grants, then grant waiting rooms in order:
        [(room, offset, bytes)]."""
        out = []
        with self._lock:
            keep = []
            for t, off in self._held:
                if t <= now:
                    self.staging.free(off)
                else:
                    keep.append((t, off))
            self._held = keep
            while self._waiting:
                room, nbytes = next(iter(self._waiting.items()))
                off = self.staging.reserve(nbytes)
                if off is None:
                    break
                del self._waiting[room]
                self.granted += 1
                out.append((room, off, nbytes))
        return out

    def free(self, offset: int, quarantine: bool) -> None:
        with self._lock:
            if quarantine:
                self._held.append((time.monotonic() + QUARANTINE_S, offset))
            else:
                self.staging.free(offset)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"staging_grants": self.granted, "staging_waits": self.waited,
                    "staging_waiting_rooms": len(self._waiting),
                    "staging_quarantined": len(self._held), **self.staging.stats()}


def scatter_grant(grants: GrantBook | None, room: int, grant: tuple[int, int] | None,
                  staged_by: set[int], responders: set[int], pages: np.ndarray | None,
                  *, prefill_tp: int) -> str:
    """D, once every writer reported Success: scatter a claimed grant into the room's pages
    when the writers staged (then free it); '' or why the room must fail."""
    if grant is None or grants is None:
        return "" if not staged_by else "prefill staged KV but decode holds no grant"
    if not staged_by:  # P wrote the pages directly (no staging on its side)
        grants.free(grant[0], quarantine=False)
        return ""
    if staged_by != responders:
        grants.free(grant[0], quarantine=True)
        return (f"prefill ranks {sorted(responders - staged_by)} did not stage their KV while "
                f"{sorted(staged_by)} did; run both sides with the same "
                f"SGLANG_DISAGG_STAGING_BUFFER")
    assert pages is not None
    try:
        grants.staging.scatter(grant[0], pages, prefill_tp)
    except Exception as e:  # a plugin bug fails the room, not the server
        log.exception("room %d: staging scatter raised", room)
        return f"staging scatter failed: {type(e).__name__}: {e}"
    finally:
        grants.free(grant[0], quarantine=False)
    return ""
