"""P's per-room bookkeeping: destinations (one per D rank), pending messages, chunk jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Dest:
    """One D rank's TransferInfo for a room."""

    session: str
    ctrl_addr: str
    rank: int
    pages: np.ndarray
    aux_slot: int


@dataclass(eq=False)
class RoomState:
    room: int
    deadline: float
    dests: dict[str, Dest] = field(default_factory=dict)
    required: int = 1
    fake: bool = False
    inflight: int = 0  # chunk jobs queued or running
    last_queued: bool = False
    final_aux: int | None = None
    abort_acks: list[str] = field(default_factory=list)  # D addresses waiting for AbortAck


@dataclass(eq=False)
class Pending:
    """Messages for a room the scheduler has not added yet (D can be faster than P)."""

    created: float
    dests: dict[str, Dest] = field(default_factory=dict)
    required: int = 1
    failure: str = ""


@dataclass(frozen=True, slots=True)
class Chunk:
    room: int
    src_pages: np.ndarray
    page_start: int
    is_last: bool
