"""Aux rows: the small per-request record P writes into D next to the KV pages.

One row per in-flight request in one registered uint8 buffer [num_slots, row_bytes]; a row holds
the first output token, its logprob, up to MAX_TOP_LOGPROBS top logprobs, cached/prompt token
counts, and the request's room. The room (with a magic word) is D's readiness and corruption
check: D reads a row only after P reported Success and accepts it only if it carries its room.
Rows are padded to a multiple of 64 bytes (the RDMA minimum) and copied whole, P slot -> D slot.

A server that speculates with a draft head (EAGLE, NEXTN) has longer rows: after the fields
above (64-byte aligned) a chain-start part, the state D's first decode step drafts from
(engine/sched/eagle.py: ChainStart): a 64-byte header (a magic word set only when P had a chain
start, the first draft token, the position it was made at) and the head's output vector there,
[hidden] in the model dtype, then padding to 64 bytes. It crosses with the row in the same copy
(or on the Status when the backend moves no data), and the room check covers it. NGRAM and
non-speculating servers have no such part: their rows, and what they move, are unchanged. P and
D agree on the part's geometry at pairing (`chain_info`, wire.check_chain). D treats what it
reads as hostile: a draft token outside the vocabulary, a position other than the prompt's end
or a non-finite vector drops the chain start (`read_chain` says why); nothing else changes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

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
ROW_BYTES = -(-_FIELDS.itemsize // ROW_ALIGN) * ROW_ALIGN  # a row without a chain start part
_CHAIN_MAGIC = 0x50444353  # "PDCS": the row carries a chain start
_CHAIN = np.dtype([("magic", "<u4"), ("draft_token", "<i4"), ("at", "<i4")])
_CHAIN_HEADER = ROW_ALIGN  # the header's bytes (padded); the vector follows it


def _align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True, slots=True)
class ChainGeometry:
    """The chain start a draft head hands over: its output vector's size and dtype, the
    vocabulary its draft token must lie in, and which head made it (`head`:
    fingerprint.draft_identity, the algorithm and the draft weights' fingerprint): a vector of
    the right size from another head is the wrong input to this one."""

    hidden: int
    dtype: torch.dtype
    vocab: int
    head: str = ""

    @property
    def nbytes(self) -> int:
        """The vector's bytes: what a chain start adds to a transfer."""
        return self.hidden * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class ChainRow:
    token: int  # the first draft token
    at: int  # the computed positions it was made at (the prompt's length)
    hidden: torch.Tensor  # [hidden], a copy in the model dtype


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

    def __init__(self, pool: MemoryPool, num_slots: int, label: str = "aux",
                 chain: ChainGeometry | None = None) -> None:
        """`chain`: the rows carry a draft head's chain start of this geometry (module doc)."""
        if num_slots < 1:
            raise ValueError("AuxBuffers needs at least one slot")
        if chain is not None and chain.hidden < 1:
            raise ValueError("a chain start needs a hidden size >= 1")
        self.num_slots = num_slots
        self.chain = chain
        self._vec = ROW_BYTES + _CHAIN_HEADER  # where the chain start's vector begins
        self.row_bytes = _align(self._vec + chain.nbytes) if chain is not None else ROW_BYTES
        buf = pool.allocate(label, (num_slots, self.row_bytes), torch.uint8)
        if buf.tensor.device.type != "cpu":
            raise ValueError(f"aux rows must live in host memory, got {buf.tensor.device}; "
                             f"give AuxBuffers a host memory pool")
        self.tensor = buf.tensor
        self.region: MemoryRegion = buf.region
        rows = buf.tensor.numpy()  # shares memory with the tensor
        self._rows = rows[:, : _FIELDS.itemsize].view(_FIELDS)[:, 0]
        self._chain = (rows[:, ROW_BYTES : ROW_BYTES + _CHAIN.itemsize].view(_CHAIN)[:, 0]
                       if chain is not None else None)
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
        if self._chain is not None:  # a chain start only where write_chain puts one
            self._chain[slot]["magic"] = 0
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

    # -- the chain start part (servers with a draft head) --------------------------------------
    @property
    def chain_bytes(self) -> int:
        """The chain start's vector bytes per row (0: no chain start part)."""
        return self.chain.nbytes if self.chain is not None else 0

    def chain_info(self) -> dict[str, Any]:
        """What P and D compare at pairing (wire.check_chain): hidden 0 without a part."""
        c = self.chain
        return {"chain_hidden": c.hidden if c else 0,
                "chain_dtype": str(c.dtype).replace("torch.", "") if c else "",
                "chain_head": c.head if c else ""}

    def write_chain(self, slot: int, token: int, at: int, hidden: torch.Tensor) -> None:
        """Put a chain start into the row at `slot` (after write(): it clears the marker)."""
        self._check(slot)
        c = self.chain
        if c is None or self._chain is None:
            raise ValueError("these aux rows carry no chain start (no draft head)")
        if hidden.numel() != c.hidden:
            raise ValueError(f"a chain start's vector has {hidden.numel()} values, the rows "
                             f"hold {c.hidden}")
        self._vector(slot).copy_(hidden.detach().reshape(-1).to(device="cpu", dtype=c.dtype))
        h = self._chain[slot]
        h["draft_token"], h["at"] = token, at
        h["magic"] = _CHAIN_MAGIC

    def read_chain(self, slot: int, at: int) -> tuple[ChainRow | None, str]:
        """The chain start in the row at `slot`, checked as hostile input: (start, "") when
        it is sound, (None, "") when the row carries none, (None, why) when it is dropped:
        made at another position than `at` (the prompt's length), a draft token outside the
        vocabulary, a non-finite vector."""
        self._check(slot)
        c = self.chain
        if c is None or self._chain is None:
            return None, ""
        h = self._chain[slot].copy()
        if int(h["magic"]) != _CHAIN_MAGIC:
            return None, ""
        token, made = int(h["draft_token"]), int(h["at"])
        if made != at:
            return None, f"made at position {made}, the prompt has {at} tokens"
        if not 0 <= token < c.vocab:
            return None, f"draft token {token} outside the vocabulary of {c.vocab}"
        vec = self._vector(slot).clone()
        if not bool(torch.isfinite(vec).all()):
            return None, "non-finite values in its hidden vector"
        return ChainRow(token, made, vec), ""

    def _vector(self, slot: int) -> torch.Tensor:
        """The row's chain start vector, a view [hidden] in the model dtype."""
        assert self.chain is not None
        return self.tensor[slot, self._vec : self._vec + self.chain.nbytes].view(self.chain.dtype)

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
