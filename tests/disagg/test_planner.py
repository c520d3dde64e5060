"""DefaultPlanner: execute the planned CopyBatch with memmove over real tensors, compare."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdcore.builtin.planner import DefaultPlanner, page_runs
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import CopyBatch

LAYERS, PAGES, PAGE, DIM = 3, 12, 4, 8


class RankKV:
    """One rank's KV pool: per layer K and V of [pages, page_size, heads, dim]."""

    def __init__(self, heads: int, tp_rank: int, tp_size: int, total: int, fill: bool,
                 is_mla: bool = False) -> None:
        shape = (PAGES, PAGE, heads, DIM)
        mk = (lambda: torch.randn(shape)) if fill else (lambda: torch.zeros(shape))
        self.k = [mk() for _ in range(LAYERS)]
        self.v = [mk() for _ in range(LAYERS)]
        self.layout = KVLayout(
            num_layers=LAYERS, page_size=PAGE, kv_heads=heads, head_dim=DIM, elem_size=4,
            k_bases=tuple(t.data_ptr() for t in self.k), v_bases=tuple(t.data_ptr() for t in self.v),
            num_pages=PAGES, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=total,
            is_mla=is_mla)


def execute(batch: CopyBatch) -> None:
    for s, d, n in zip(batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()):
        ctypes.memmove(d, s, n)


def ranks(total: int, tp: int, fill: bool) -> list[RankKV]:
    heads = max(1, total // tp)
    return [RankKV(heads, r, tp, total, fill) for r in range(tp)]


def logical(prank: list[RankKV], layer: int, which: str, page: int, total: int) -> torch.Tensor:
    """The model's full [page_size, total_heads, dim] for one page, from P's ranks."""
    out = torch.empty(PAGE, total, DIM)
    for rk in prank:
        first, n = rk.layout.head_span
        out[:, first:first + n] = getattr(rk, which)[layer][page]
    return out


SRC = np.array([0, 1, 2, 5, 6, 9], dtype=np.int64)
DST = np.array([3, 4, 5, 0, 1, 11], dtype=np.int64)


def check(p: list[RankKV], d: list[RankKV], total: int) -> None:
    planner = DefaultPlanner()
    for dr in d:
        for pr in p:
            ok, _ = planner.supports(pr.layout, dr.layout)
            if ok:
                execute(planner.plan(pr.layout, dr.layout, SRC, DST))
    copied = set(DST.tolist())
    for dr in d:
        first, n = dr.layout.head_span
        for layer in range(LAYERS):
            for which in ("k", "v"):
                for s, t in zip(SRC.tolist(), DST.tolist()):
                    want = logical(p, layer, which, s, total)[:, first:first + n]
                    assert torch.equal(getattr(dr, which)[layer][t], want), (layer, which, s, t)
                for t in set(range(PAGES)) - copied:  # nothing else was touched
                    assert not getattr(dr, which)[layer][t].any()


def test_page_runs_coalesce_on_both_sides() -> None:
    s, d, n = page_runs(SRC, DST)
    assert s.tolist() == [0, 5, 9] and d.tolist() == [3, 0, 11] and n.tolist() == [3, 2, 1]
    p, dd = ranks(2, 1, True), ranks(2, 1, False)
    batch = DefaultPlanner().plan(p[0].layout, dd[0].layout, SRC, DST)
    assert len(batch) == 3 * 2 * LAYERS  # one descriptor per run per layer for K and V
    assert batch.nbytes == len(SRC) * 2 * LAYERS * p[0].layout.item_len


def test_same_tp() -> None:
    check(ranks(2, 1, True), ranks(2, 1, False), 2)


def test_same_tp_two_ranks() -> None:
    check(ranks(4, 2, True), ranks(4, 2, False), 4)


def test_prefill_tp2_to_decode_tp1() -> None:
    check(ranks(4, 2, True), ranks(4, 1, False), 4)


def test_prefill_tp1_to_decode_tp2() -> None:
    check(ranks(4, 1, True), ranks(4, 2, False), 4)


def test_gqa_replication_decode_tp4_two_heads() -> None:
    d = ranks(2, 4, False)
    assert [r.layout.head_span[0] for r in d] == [0, 0, 1, 1]
    check(ranks(2, 1, True), d, 2)


def test_gqa_replication_prefill_tp4_to_decode_tp1() -> None:
    check(ranks(2, 4, True), ranks(2, 1, False), 2)


def test_token_count_limits_slices() -> None:
    p, d = ranks(4, 1, True), ranks(4, 2, False)
    full = DefaultPlanner().plan(p[0].layout, d[0].layout, SRC, DST)
    part = DefaultPlanner().plan(p[0].layout, d[0].layout, SRC, DST, token_count=len(SRC) * PAGE - 3)
    assert len(full) - len(part) == 3 * 2 * LAYERS


def test_supports_mla_hetero_and_rejects_mismatches() -> None:
    p = RankKV(1, 0, 2, 1, True, is_mla=True)
    d = RankKV(1, 0, 1, 1, False, is_mla=True)
    assert DefaultPlanner().supports(p.layout, d.layout) == (True, "")  # tests/disagg/test_mla_*
    same = RankKV(1, 0, 1, 1, False, is_mla=True)
    assert DefaultPlanner().supports(d.layout, same.layout) == (True, "")
    a, b = ranks(2, 1, True)[0], ranks(2, 1, False)[0]
    from dataclasses import replace
    ok, why = DefaultPlanner().supports(a.layout, replace(b.layout, page_size=8))
    assert not ok and "page_size" in why
    with pytest.raises(ValueError, match="page_size"):
        DefaultPlanner().plan(a.layout, replace(b.layout, page_size=8), SRC, DST)
    with pytest.raises(ValueError, match="pair up"):
        DefaultPlanner().plan(a.layout, b.layout, SRC, DST[:-1])
