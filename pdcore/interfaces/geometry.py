"""KV head geometry and TP rank mapping: the one rule the engine, the planners and the staging
plugin share, so that what a rank holds and what a peer expects it to hold never disagree.

Heads are split into floor spans: rank r of `size` holds [r*total//size, (r+1)*total//size), so
3 KV heads on 2 ranks run as 1 + 2. When TP exceeds the KV head count every rank holds one
(replicated) head, the one its floor position falls in.
"""

from __future__ import annotations

from pdcore.errors import ProtocolError


def span(total: int, rank: int, size: int) -> tuple[int, int]:
    """(first, count) of rank's floor share of `total` items split over `size` ranks."""
    first = rank * total // size
    return first, (rank + 1) * total // size - first


def kv_head_span(total_kv: int, rank: int, size: int) -> tuple[int, int]:
    """KV heads a rank holds: its floor share, or one replicated head when size > total_kv."""
    if size <= total_kv:
        return span(total_kv, rank, size)
    return rank * total_kv // size, 1


def model_kv_heads(total_kv_heads: int | None, kv_heads: int, tp_size: int) -> int:
    """The model's KV head count; unknown (0 or None) means every rank holds its own heads."""
    return total_kv_heads or kv_heads * tp_size


def rank_mapping(p_tp: int, d_tp: int, d_rank: int, is_mla: bool) -> tuple[list[int], int, int]:
    """For decode rank `d_rank`: (P ranks to pull from, TransferInfos each of them waits for,
    Success statuses to wait for). Raises ProtocolError when the TP sizes cannot pair."""
    if p_tp == d_tp:
        return [d_rank], 1, 1
    if is_mla:
        return mla_rank_mapping(p_tp, d_tp, d_rank)
    if d_tp > p_tp:
        if d_tp % p_tp:
            raise ProtocolError(f"decode TP {d_tp} is not a multiple of prefill TP {p_tp}")
        return [d_rank // (d_tp // p_tp)], d_tp // p_tp, 1
    if p_tp % d_tp:
        raise ProtocolError(f"prefill TP {p_tp} is not a multiple of decode TP {d_tp}")
    k = p_tp // d_tp
    return list(range(d_rank * k, (d_rank + 1) * k)), 1, k


def mla_rank_mapping(p_tp: int, d_tp: int, d_rank: int) -> tuple[list[int], int, int]:
    """MLA: every rank holds the same latent KV, so any TP sizes pair (no head slicing). Each
    P rank is paired with D ranks by rank modulo the smaller size, so every P rank hears from
    some D rank (a rank no D rank registers with would wait for a destination forever), and
    each D rank's pages are written by exactly one P rank: `mla_sender`. The other P ranks
    paired with it send an empty plan and report Success."""
    if d_tp > p_tp:  # several D ranks read the same P rank: it waits for all of them
        src = d_rank % p_tp
        return [src], len(range(src, d_tp, p_tp)), 1
    targets = list(range(d_rank, p_tp, d_tp))
    return targets, 1, len(targets)


def mla_sender(p_rank: int, p_tp: int, d_rank: int) -> bool:
    """Whether prefill rank p_rank writes decode rank d_rank's latent KV (see mla_rank_mapping)."""
    return p_rank == d_rank % p_tp
