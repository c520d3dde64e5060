"""P's per-room bookkeeping: destinations (one per D rank), pending messages, chunk jobs,
which send() calls break the protocol, and what the scheduler reads of the destinations
(DestViews)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pdcore.disagg.common import UNBOUNDED_PAGES
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
    prompt_digest: str = ""  # wire.prefix_digest of D's whole prompt (must be P's)


@dataclass(eq=False)
class RoomState:
    room: int
    deadline: float
    dests: dict[str, Dest] = field(default_factory=dict)
    required: int = 1
    fake: bool = False
    decode_id: str = ""  # the decode server the room is bound to (the first that claimed it)
    claimed: bool = False  # a decode server claimed it (else it fails at the claim timeout)
    claim_deadline: float = float("inf")
    claimers: list[str] = field(default_factory=list)  # D ranks (ctrl addrs) that claimed it
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
    failure_code: str = ""  # e.g. route_refused: decode refused the route before P added it
    decode_id: str = ""
    claims: list[str] = field(default_factory=list)  # D ranks (ctrl addrs) awaiting Claimed
    peer: str = ""  # the decode server whose message opened it (PendingTable's quota)


class PendingTable:
    """P's Pending entries (rooms D named before P has their request), bounded: at most
    `per_peer` opened by one decode server and `total` in all. Opening one more evicts the
    oldest of that peer (at its quota) or the oldest of all (when full): a flood of claims for
    rooms that never come costs the flooder its own oldest entries first, and real rooms, whose
    request reaches P within moments, are the newest. Callers hold the manager's lock."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self._items: dict[int, Pending] = {}  # insertion order: oldest first
        self._by_peer: dict[str, OrderedDict[int, None]] = {}
        self.evicted = 0

    def open(self, room: int, peer: str, now: float) -> tuple[Pending, list[tuple[int, Pending]]]:
        """The room's entry (a new one opened by `peer` if none) and the entries it evicted."""
        p = self._items.get(room)
        if p is not None:
            return p, []
        evicted = []
        mine = self._by_peer.get(peer)
        if mine is not None and len(mine) >= self.per_peer:
            oldest = next(iter(mine))
            evicted.append((oldest, self.pop(oldest)))
        while len(self._items) >= self.total:
            oldest = next(iter(self._items))
            evicted.append((oldest, self.pop(oldest)))
        self.evicted += len(evicted)
        p = self._items[room] = Pending(now, peer=peer)
        self._by_peer.setdefault(peer, OrderedDict())[room] = None
        return p, [(r, q) for r, q in evicted if q is not None]

    def get(self, room: int) -> Pending | None:
        return self._items.get(room)

    def pop(self, room: int, default: None = None) -> Pending | None:
        p = self._items.pop(room, None)
        if p is not None:
            mine = self._by_peer.get(p.peer)
            if mine is not None:
                mine.pop(room, None)
                if not mine:
                    del self._by_peer[p.peer]
        return p

    def __delitem__(self, room: int) -> None:
        self.pop(room)

    def __contains__(self, room: object) -> bool:
        return room in self._items

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[int, Pending]]:
        return list(self._items.items())


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


class DestViews:
    """What P's scheduler reads about a room's destinations (a part of PrefillKVManager, which
    answers the scheduler's dest_page_count / dest_prefix / dest_prompt through it)."""

    def __init__(self, lock: threading.RLock, rooms: dict[int, RoomState]) -> None:
        self._lock, self._rooms = lock, rooms

    def page_count(self, room: int) -> int:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return 0
            if r.fake:
                return UNBOUNDED_PAGES
            return min((len(d.pages) for d in r.dests.values()), default=0)

    def prefix(self, room: int) -> tuple[int, str]:
        """(pages, digest) of the prompt prefix every D rank of the room holds already; (0, '')
        when none or the room is unknown; (-1, '') when D's ranks disagree."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.fake or not r.dests:
                return 0, ""
            seen = {(d.prefix_pages, d.prefix_digest) for d in r.dests.values()}
        return next(iter(seen)) if len(seen) == 1 else (-1, "")

    def prompt(self, room: int) -> str | None:
        """The digest of the whole prompt the room's decode ranks hold ('' when they disagree);
        None when there is nothing to compare (unknown or warm-up room, no destination yet)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.fake or not r.dests:
                return None
            seen = {d.prompt_digest for d in r.dests.values()}
        return next(iter(seen)) if len(seen) == 1 else ""
