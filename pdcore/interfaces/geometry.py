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
        raise ProtocolError(f"MLA models need the same TP size on prefill ({p_tp}) and decode "
                            f"({d_tp})")
    if d_tp > p_tp:
        if d_tp % p_tp:
            raise ProtocolError(f"decode TP {d_tp} is not a multiple of prefill TP {p_tp}")
        return [d_rank // (d_tp // p_tp)], d_tp // p_tp, 1
    if p_tp % d_tp:
        raise ProtocolError(f"prefill TP {p_tp} is not a multiple of decode TP {d_tp}")
    k = p_tp // d_tp
    return list(range(d_rank * k, (d_rank + 1) * k)), 1, k
