"""Poll states every TP rank agrees on: each rank's KV manager reports its own view of a room;
the scheduler extensions act on the element-wise MIN over the TP group, so a room is Success
only when it is Success on every rank and one failed rank fails the room everywhere.

1. every rank polls its manager for the same rooms (the schedules are identical), plus any
   per-room counts the decision needs (e.g. destination pages on P), in one all-reduce;
2. when some room is Failed by agreement, the ranks exchange their failure reasons (one
   all-gather, only in that case) so rank 0 reports the real cause to the client;
3. a rank whose own manager had not failed the room fails it locally too, which sends the
   usual notices to the peer (Status(Failed) from P, Abort from D) and frees its state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcore.disagg.states import KVPoll
from pdcore.engine.model.layers import TPInfo


@dataclass
class Agreed:
    states: dict[int, KVPoll] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    extra: dict[int, tuple[int, ...]] = field(default_factory=dict)  # MIN of each `extra` value

    def state(self, room: int) -> KVPoll:
        return self.states.get(room, KVPoll.Failed)


def poll_all(mgr: Any, rooms: Sequence[int], tp: TPInfo,
             count: Callable[[int], int] | None = None,
             extra: Sequence[Callable[[int], int]] = ()) -> Agreed:
    """Agreed states (and MIN of `count(room)` when given, and of each `extra` function's
    value) for `rooms`; everything in the same one all-reduce. Counts and extras are read
    after every state, so a value never predates the state it is agreed with."""
    rooms = list(dict.fromkeys(rooms))
    n = len(rooms)
    local = [int(mgr.poll(r)) for r in rooms]
    counts = [int(count(r)) for r in rooms] if count is not None else []
    extras = [int(f(r)) for f in extra for r in rooms]
    if tp.size > 1 and rooms:
        merged = tp.all_min(local + counts + extras)
        agreed, counts, extras = merged[:n], merged[n:n + len(counts)], merged[n + len(counts):]
    else:
        agreed = local
    out = Agreed({r: KVPoll(s) for r, s in zip(rooms, agreed)},
                 dict(zip(rooms, counts)) if count is not None else {},
                 extra={r: tuple(int(extras[i * n + j]) for i in range(len(extra)))
                        for j, r in enumerate(rooms)} if extra else {})
    failed = [r for r, s in zip(rooms, agreed) if s == KVPoll.Failed]
    if not failed:
        return out
    mine = {r: mgr.failure_reason(r) for r, s in zip(rooms, local)
            if s == KVPoll.Failed and r in set(failed)}
    gathered = tp.all_gather_object(mine) if tp.size > 1 else [mine]
    for rank, reasons in enumerate(gathered):
        for r, why in (reasons or {}).items():
            if r not in out.reasons and why:
                out.reasons[r] = why if rank == tp.rank else f"TP rank {rank}: {why}"
    for r in failed:
        out.reasons.setdefault(r, "the transfer failed on another TP rank")
    for r, s in zip(rooms, local):
        if s != KVPoll.Failed and r in out.reasons:  # another rank failed it: follow
            mgr.abort(r, out.reasons[r])
    return out
