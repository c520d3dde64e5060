"""P's per-room bookkeeping: destinations (one per D rank), pending messages, chunk jobs, and
which send() calls break the protocol."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdcore.disagg.states import KVPoll


@dataclass(eq=False)
class Dest:
    """One D rank's TransferInfo for a room."""

    session: str
    ctrl_addr: str
    rank: int
    pages: np.ndarray
    aux_slot: int
    grant_off: int = -1  # D's staging grant for this room (-1: none)
    grant_len: int = 0
    staged: bool = False  # some chunk went through the grant (D must scatter)
    prefix_pages: int = 0  # leading pages D holds already (its prefix cache): never written
    prefix_digest: str = ""  # wire.prefix_digest of their tokens


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


def send_violation(r: RoomState, state: KVPoll | None, pages: np.ndarray, page_start: int,
                   aux_slot: int | None, num_aux: int) -> str:
    """Why a send() of these pages cannot go out for this room now ('' when it can).
    `aux_slot` is the last chunk's aux slot (None on other chunks)."""
    if state is not KVPoll.WaitingForInput and state is not KVPoll.Transferring:
        return (f"send() in state {state.name if state else None}; wait until poll() is "
                "WaitingForInput")
    if r.last_queued:
        return "send() after the last chunk"
    for d in r.dests.values():
        if page_start < 0 or page_start + len(pages) > len(d.pages):
            return (f"chunk pages [{page_start}, {page_start + len(pages)}) exceed the "
                    f"{len(d.pages)} pages decode rank {d.rank} reserved")
        if len(pages) and page_start < d.prefix_pages:
            return (f"chunk pages [{page_start}, {page_start + len(pages)}) overlap the "
                    f"{d.prefix_pages} cached prefix pages decode rank {d.rank} holds already")
    if aux_slot is not None and not 0 <= aux_slot < num_aux:
        return f"prefill aux slot {aux_slot} out of range"
    return ""
