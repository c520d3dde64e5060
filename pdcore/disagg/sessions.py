"""P's view of a registered decode rank ("session"), and every check made before writing into it.

A Register message is validated once (layout consistent, every K/V buffer inside a region D
registered, aux rows fit D's aux region, page size / dtype / backend / planner compatible); a
TransferInfo is validated per room (every page index < D's num_pages, aux slot < D's slots); and
each planned CopyBatch is checked against D's registered regions before the backend sees it.
A hostile or buggy message can therefore never make P write outside D's pools.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdcore.backendkit import RegionIndex
from pdcore.disagg import wire
from pdcore.errors import ProtocolError, TransferError
from pdcore.interfaces.planner import KVLayout, TransferPlanner
from pdcore.messages.bootstrap import BootstrapInfo
from pdcore.interfaces.transfer import (
    CopyBatch,
    MemoryRegion,
    Peer,
    TransferEngine,
    TransferStatus,
)


@dataclass(eq=False)
class DecodeSession:
    key: str
    reg: wire.Register
    layout: KVLayout
    kv: RegionIndex
    aux_region: MemoryRegion
    regions: list[MemoryRegion]
    peer: Peer | None = None
    failed: str = ""  # non-empty: a transfer into this session failed; rooms fail fast
    failed_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)  # serialises connect
    staging: MemoryRegion | None = None  # D's staging ring, when it has one

    @property
    def aux_slots(self) -> int:
        return self.reg.aux_slots

    def check_pages(self, pages: np.ndarray) -> str:
        """'' when every page index is inside D's pool, else why not."""
        if len(pages) and (pages.min() < 0 or pages.max() >= self.layout.num_pages):
            bad = pages[(pages < 0) | (pages >= self.layout.num_pages)]
            return (f"destination page index {int(bad[0])} is outside decode's pool of "
                    f"{self.layout.num_pages} pages ({len(bad)} bad indices)")
        return ""

    def check_aux_slot(self, slot: int) -> str:
        if slot != wire.NO_AUX_SLOT and not 0 <= slot < self.aux_slots:
            return f"aux slot {slot} is outside decode's {self.aux_slots} aux slots"
        return ""

    def check_grant(self, offset: int, length: int) -> str:
        """'' when a staging grant lies inside D's staging ring (or there is none)."""
        if offset < 0:
            return ""
        if self.staging is None or length < 1 or offset + length > self.staging.length:
            size = self.staging.length if self.staging else 0
            return f"staging grant [{offset}, {offset + length}) outside decode's {size}-byte ring"
        return ""

    def check_grant_batch(self, batch: CopyBatch, offset: int, length: int) -> None:
        assert self.staging is not None
        lo = self.staging.addr + offset
        grant = RegionIndex([MemoryRegion(lo, length)])
        if not grant.contains(batch.dst, batch.length):
            raise TransferError(f"refusing a staged copy outside the room's grant in decode "
                                f"session {self.key}'s ring (staging planner bug)")

    def check_kv_batch(self, batch: CopyBatch) -> None:
        if not self.kv.contains(batch.dst, batch.length):
            raise TransferError(f"refusing a planned copy outside decode session {self.key}'s "
                                f"registered KV memory (planner or layout bug)")

    def aux_addr(self, slot: int) -> int:
        return self.aux_region.addr + slot * self.reg.aux_row_bytes

    def write(self, backend: TransferEngine, batch: CopyBatch, timeout: float) -> None:
        """Write batch into this D rank (split to the backend's max batch) and wait for it.

        Raises TransferError with the backend's reason; the caller marks the session failed.
        """
        with self.lock:
            if self.peer is None:
                ring = [self.staging] if self.staging is not None else []
                self.peer = backend.connect(self.reg.endpoint,
                                            [*self.regions, self.aux_region, *ring])
            peer = self.peer
        handles = [backend.write(peer, b) for b in batch.split(backend.capabilities.max_batch)]
        deadline = time.monotonic() + timeout
        for h in handles:
            left = deadline - time.monotonic()
            res = backend.wait(h, left) if left > 0 else backend.poll(h)
            if res.status is TransferStatus.PENDING:
                raise TransferError(f"write not done after {timeout:g}s")
            if res.status is not TransferStatus.DONE:
                raise TransferError(res.reason or "backend reported failure")


def parse_register(msg: wire.Register, local: KVLayout, backend: str, row_bytes: int,
                   planner: TransferPlanner, fingerprint: str = "",
                   *, chain: dict[str, Any] | None = None) -> DecodeSession:
    """Validate a Register; ProtocolError says what is wrong. `chain`: this server's chain
    start geometry (AuxBuffers.chain_info()), compared before the aux row size it sets."""
    wire.check_compatible("decode", msg.page_size, msg.dtype, local)
    if msg.backend != backend:
        raise ProtocolError(f"decode uses transfer backend {msg.backend!r}, prefill uses "
                            f"{backend!r}; start both with the same --disaggregation-transfer-backend")
    try:
        layout = KVLayout.from_dict(msg.layout)
        regions = [MemoryRegion.from_dict(d) for d in msg.regions]
        aux_region = MemoryRegion.from_dict(msg.aux_region)
        staging = (MemoryRegion.from_dict(msg.staging_region) if msg.staging_region is not None
                   else None)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed decode registration: {type(e).__name__}: {e}") from None
    if layout.page_size != msg.page_size or str(layout.dtype) != msg.dtype:
        raise ProtocolError("decode registration: layout disagrees with its page_size/dtype")
    wire.check_pairing("decode", BootstrapInfo(
        tp_size=msg.tp_size, page_size=msg.page_size, kv_cache_dtype=msg.dtype,
        model_fingerprint=msg.model_fingerprint, num_layers=layout.num_layers,
        head_dim=layout.head_dim, is_mla=layout.is_mla, draft_layers=layout.draft_layers,
        chain_hidden=msg.chain_hidden, chain_dtype=msg.chain_dtype,
        chain_head=msg.chain_head), local, fingerprint, chain)
    if layout.num_pages < 1 or layout.num_layers < 1 or layout.item_len < 1:
        raise ProtocolError("decode registration: empty KV layout")
    if len(layout.k_bases) != layout.num_layers or len(layout.v_bases) != layout.num_layers:
        raise ProtocolError("decode registration: k_bases/v_bases do not match num_layers")
    kv = RegionIndex(regions)
    bases = np.array(layout.k_bases + layout.v_bases, dtype=np.uint64)
    span = np.full(len(bases), layout.num_pages * layout.item_len, dtype=np.uint64)
    if not kv.contains(bases, span):
        raise ProtocolError("decode registration: a K/V buffer lies outside its registered "
                            "memory regions")
    if msg.aux_row_bytes != row_bytes:
        raise ProtocolError(f"decode aux rows are {msg.aux_row_bytes} bytes, prefill's are "
                            f"{row_bytes}; run the same pdserve version on both")
    if msg.aux_slots < 1 or aux_region.length < msg.aux_slots * msg.aux_row_bytes:
        raise ProtocolError("decode registration: aux region smaller than its aux slots")
    ok, why = planner.supports(local, layout)
    if not ok:
        raise ProtocolError(f"cannot transfer to decode rank {msg.rank}: {why}")
    return DecodeSession(key=msg.session, reg=msg, layout=layout, kv=kv, aux_region=aux_region,
                         regions=regions, staging=staging)
