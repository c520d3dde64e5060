"""Where each prefill rank's head slice lives inside a decode rank's staging grant.

A room's grant on decode rank d is one block per writer (the P ranks d pulls from, in rank
order). A writer's block is page-major, `[pages, 2 * layers, page_size, heads, head_dim]` (K
layers then V layers per page), so the slice of any run of pages is ONE contiguous byte range:
a chunk is gathered into a buffer in that order and lands with a single write. `pages` covers
every page decode reserved for the room, so the layout never depends on how P chunks the
prompt.

Both sides derive the same geometry from (P's TP size, decode's layout): heads follow the
engine's floor split (pdcore.interfaces.geometry), so uneven splits (3 KV heads on 2 ranks) and
GQA replication (TP > KV heads) are covered.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcore.interfaces.geometry import kv_head_span as head_span
from pdcore.interfaces.geometry import rank_mapping
from pdcore.interfaces.planner import KVLayout


@dataclass(frozen=True, slots=True)
class Writer:
    p_rank: int
    first: int  # first model KV head of the slice this writer sends
    count: int  # heads in the slice
    block_off: int  # byte offset of the writer's block in the grant

    def token_bytes(self, layout: KVLayout) -> int:
        return 2 * layout.num_layers * self.count * layout.head_dim * layout.elem_size


@dataclass(frozen=True, slots=True)
class Grant:
    writers: tuple[Writer, ...]
    tokens: int
    nbytes: int

    def writer(self, p_rank: int) -> Writer:
        for w in self.writers:
            if w.p_rank == p_rank:
                return w
        raise ValueError(f"prefill rank {p_rank} does not write to this decode rank")


def same_heads(p_tp: int, dst: KVLayout) -> bool:
    """Every P rank dst pulls from holds exactly dst's heads: whole pages line up, no staging."""
    targets, _, _ = rank_mapping(p_tp, dst.tp_size, dst.tp_rank, False)
    total, d = dst.model_kv_heads, dst.head_span
    return all(head_span(total, t, p_tp) == d for t in targets)


def grant_geometry(p_tp: int, dst: KVLayout, num_pages: int) -> Grant:
    """The writers of a room on decode rank `dst` and the grant's size (0 when not staged)."""
    if same_heads(p_tp, dst):
        return Grant((), num_pages * dst.page_size, 0)
    targets, _, _ = rank_mapping(p_tp, dst.tp_size, dst.tp_rank, False)
    total = dst.model_kv_heads
    d0, dn = dst.head_span
    tokens = num_pages * dst.page_size
    writers, off = [], 0
    for t in targets:
        p0, pn = head_span(total, t, p_tp)
        first, last = max(p0, d0), min(p0 + pn, d0 + dn)
        if last <= first:
            raise ValueError(f"prefill rank {t}/{p_tp} shares no KV head with decode rank "
                             f"{dst.tp_rank}/{dst.tp_size}")
        w = Writer(t, first, last - first, off)
        writers.append(w)
        off += tokens * w.token_bytes(dst)
    return Grant(tuple(writers), tokens, off)
