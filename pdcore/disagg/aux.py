"""Aux rows: the small per-request record P writes into D next to the KV pages.

One row per in-flight request in one registered uint8 buffer [num_slots, row_bytes]; a row holds
the first output token, its logprob, up to MAX_TOP_LOGPROBS top logprobs, cached/prompt token
counts, and the request's room. The room (with a magic word) is D's readiness and corruption
check: D reads a row only after P reported Success and accepts it only if it carries its room.
Rows are padded to a multiple of 64 bytes (the RDMA minimum) and copied whole, P slot -> D slot.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from pdcore.interfaces.memory import MemoryPool
from pdcore.interfaces.transfer import MemoryRegion

MAX_TOP_LOGPROBS = 20
ROW_ALIGN = 64
_MAGIC = 0x50444158  # "PDAX": set on write, zeroed on clear
_FIELDS = np.dtype([
    ("room", "<i8"), ("magic", "<u4"), ("first_token_id", "<i4"), ("cached_tokens", "<i4"),
    ("prompt_tokens", "<i4"), ("num_top", "<i4"), ("logprob", "<f4"),
    ("top_ids", "<i4", (MAX_TOP_LOGPROBS,)), ("top_logprobs", "<f4", (MAX_TOP_LOGPROBS,)),
])
ROW_BYTES = -(-_FIELDS.itemsize // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True, slots=True)
class AuxRow:
    room: int
    first_token_id: int
    logprob: float = 0.0
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    cached_tokens: int = 0
    prompt_tokens: int = 0


EMPTY_ROOM = -1  # what read() reports for a row never written or cleared


class AuxBuffers:
    """Aux rows in pool memory plus a FIFO free-slot allocator (thread-safe)."""

    def __init__(self, pool: MemoryPool, num_slots: int, label: str = "aux") -> None:
        if num_slots < 1:
            raise ValueError("AuxBuffers needs at least one slot")
        self.num_slots = num_slots
        self.row_bytes = ROW_BYTES
        buf = pool.allocate(label, (num_slots, ROW_BYTES), torch.uint8)
        if buf.tensor.device.type != "cpu":
            raise ValueError(f"aux rows must live in host memory, got {buf.tensor.device}; "
                             f"give AuxBuffers a host memory pool")
        self.tensor = buf.tensor
        self.region: MemoryRegion = buf.region
        rows = buf.tensor.numpy()  # shares memory with the tensor
        self._rows = rows[:, : _FIELDS.itemsize].view(_FIELDS)[:, 0]
        self._raw = rows
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()

    # -- slot allocator --------------------------------------------------------------------
    def alloc(self) -> int | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.popleft()
            self._used.add(slot)
            return slot

    def free(self, slot: int) -> None:
        self._check(slot)
        with self._lock:
            if slot not in self._used:
                raise ValueError(f"aux slot {slot} is not allocated (double free?)")
            self._used.discard(slot)
            self.clear(slot)
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    # -- rows ------------------------------------------------------------------------------
    def write(self, slot: int, row: AuxRow) -> None:
        self._check(slot)
        if len(row.top_ids) != len(row.top_logprobs):
            raise ValueError("AuxRow.top_ids and top_logprobs must have the same length")
        n = len(row.top_ids)
        if n > MAX_TOP_LOGPROBS:
            raise ValueError(f"at most {MAX_TOP_LOGPROBS} top logprobs fit an aux row, got {n}")
        r = self._rows[slot]
        r["first_token_id"] = row.first_token_id
        r["logprob"] = row.logprob
        r["cached_tokens"] = row.cached_tokens
        r["prompt_tokens"] = row.prompt_tokens
        r["num_top"] = n
        r["top_ids"][:] = 0
        r["top_logprobs"][:] = 0
        if n:
            r["top_ids"][:n] = row.top_ids
            r["top_logprobs"][:n] = row.top_logprobs
        r["room"] = row.room
        r["magic"] = _MAGIC

    def read(self, slot: int) -> AuxRow:
        """The row at `slot`; room == EMPTY_ROOM when it was never written or was cleared."""
        self._check(slot)
        r = self._rows[slot].copy()
        if int(r["magic"]) != _MAGIC:
            return AuxRow(room=EMPTY_ROOM, first_token_id=0)
        n = max(0, min(int(r["num_top"]), MAX_TOP_LOGPROBS))
        return AuxRow(
            room=int(r["room"]), first_token_id=int(r["first_token_id"]),
            logprob=float(r["logprob"]),
            top_ids=tuple(int(x) for x in r["top_ids"][:n]),
            top_logprobs=tuple(float(x) for x in r["top_logprobs"][:n]),
            cached_tokens=int(r["cached_tokens"]), prompt_tokens=int(r["prompt_tokens"]),
        )

    def clear(self, slot: int) -> None:
        self._check(slot)
        self._raw[slot, :] = 0

    def raw(self, slot: int) -> bytes:
        """The row's bytes (for the control-plane fallback when the backend moves no data)."""
        self._check(slot)
        return self._raw[slot].tobytes()

    def write_raw(self, slot: int, data: bytes) -> None:
        self._check(slot)
        if len(data) != self.row_bytes:
            raise ValueError(f"aux row payload has {len(data)} bytes, rows have {self.row_bytes}")
        self._raw[slot, :] = np.frombuffer(data, dtype=np.uint8)

    def slot_addr(self, slot: int) -> int:
        self._check(slot)
        return self.region.addr + slot * self.row_bytes

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"aux slot {slot} out of range [0, {self.num_slots})")
