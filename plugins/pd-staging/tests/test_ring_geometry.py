"""Units: the ring allocator, grant geometry, gather/scatter round trip, planner decisions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pd_staging.buffers import PrefillBuffers
from pd_staging.geometry import grant_geometry, head_span, same_heads
from pd_staging.planner import StagingTransferPlanner
from pd_staging.ring import DecodeRing, RingAllocator
from staging_util import RankKV

from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.planner import StagingContext


def test_ring_allocator_wraps_coalesces_and_refuses_when_full():
    r = RingAllocator(1024, align=64)
    a, b, c = r.alloc(300), r.alloc(300), r.alloc(300)
    assert (a, b, c) == (0, 320, 640)
    assert r.alloc(200) is None  # 64 bytes left
    r.free(a)
    assert r.alloc(200) == 0  # wrapped to the freed head
    r.free(b)
    r.free(c)
    r.free(0)
    assert r.used_bytes == 0
    assert r.alloc(1024) == 0  # everything coalesced into one block again
    with pytest.raises(ValueError):
        r.free(64)


def test_ring_allocator_next_fit_moves_forward():
    r = RingAllocator(1000, align=1)
    x = r.alloc(100)
    r.free(x)
    assert r.alloc(100) == 100  # the cursor moved on: freed space behind it is reused last


def test_head_span_matches_engine_split():
    from pdcore.engine.model.layers import kv_head_span

    for total in (1, 2, 3, 4, 8):
        for tp in (1, 2, 3, 4, 8):
            for rank in range(tp):
                assert head_span(total, rank, tp) == kv_head_span(total, rank, tp)


def test_grant_geometry_blocks_cover_decode_heads():
    d = RankKV(0, 1, 3).layout  # decode TP 1 holds 3 heads, P TP 2 holds 1 + 2
    g = grant_geometry(2, d, num_pages=5)
    assert [(w.p_rank, w.first, w.count) for w in g.writers] == [(0, 0, 1), (1, 1, 2)]
    per_head_token = 2 * d.num_layers * d.head_dim * d.elem_size
    assert g.writers[1].block_off == g.tokens * per_head_token
    assert g.nbytes == g.tokens * 3 * per_head_token
    assert same_heads(2, RankKV(1, 4, 2).layout)  # D rank 1 of 4 holds head 0 = P rank 0's
    assert grant_geometry(2, RankKV(1, 4, 2).layout, 5).nbytes == 0


@pytest.mark.parametrize("p_tp,d_tp,heads", [(2, 1, 3), (1, 2, 3), (4, 2, 4)])
def test_gather_then_scatter_round_trip(p_tp, d_tp, heads):
    pages_src, pages_dst = np.array([1, 2, 7]), np.array([9, 4, 5])
    for d_rank in range(d_tp):
        dkv = RankKV(d_rank, d_tp, heads)
        ring = DecodeRing(StagingContext(dkv.layout, dkv.layers, dkv.pool, 0, 1 << 20, 0))
        g = grant_geometry(p_tp, dkv.layout, len(pages_dst))
        off = ring.reserve(g.nbytes)
        for w in g.writers:
            pkv = RankKV(w.p_rank, p_tp, heads, seed=3)
            bufs = PrefillBuffers(StagingContext(pkv.layout, pkv.layers, pkv.pool, 1 << 16, 0, 1))
            with bufs.stage(dkv.layout, pages_src[:2], 0, 3, ring.region.addr + off,
                            g.nbytes) as b1:
                _copy(b1)
            with bufs.stage(dkv.layout, pages_src[2:], 2, 3, ring.region.addr + off,
                            g.nbytes) as b2:
                _copy(b2)
        ring.scatter(off, pages_dst, p_tp)
        full = RankKV(0, 1, heads, seed=3)  # TP 1 holds every head: the reference
        want = full.dump(pages_src)[..., dkv.first:dkv.first + dkv.layout.kv_heads, :]
        np.testing.assert_array_equal(dkv.dump(pages_dst), want)


def _copy(batch) -> None:
    import ctypes

    for s, d, n in zip(batch.src, batch.dst, batch.length):
        ctypes.memmove(int(d), int(s), int(n))


def test_chunk_larger_than_buffer_raises_transfer_error():
    pkv, dkv = RankKV(0, 2, 2, seed=1), RankKV(0, 1, 2)
    bufs = PrefillBuffers(StagingContext(pkv.layout, pkv.layers, pkv.pool, 100, 0, 1))
    with (pytest.raises(TransferError, match="SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB"),
          bufs.stage(dkv.layout, np.array([1, 2]), 0, 2, 0, 1 << 20)):
        pass
    assert bufs._free.qsize() == 1  # the buffer was not taken


def test_planner_decisions_and_mla_refusal():
    import dataclasses

    p = StagingTransferPlanner()
    a, b = RankKV(0, 2, 2).layout, RankKV(0, 1, 2).layout
    assert p.staged(a, b) and p.staged(b, RankKV(1, 2, 2).layout)
    assert not p.staged(a, RankKV(0, 2, 2).layout)
    mla = dataclasses.replace(a, is_mla=True)
    ok, why = p.supports(mla, dataclasses.replace(b, is_mla=True))
    assert not ok and "MLA" in why
    kv = RankKV(0, 1, 2)
    with pytest.raises(ConfigError, match="MLA"):
        p.open_decode(StagingContext(dataclasses.replace(kv.layout, is_mla=True), kv.layers,
                                     kv.pool, 1, 1, 1))


def test_scattered_pages_take_the_indexed_path_with_the_same_result(monkeypatch):
    from pd_staging import copies

    kv = RankKV(0, 1, 3, seed=4)
    pages = np.array([9, 2, 40, 7, 13, 11, 30, 5, 22, 1, 50])  # 11 runs > MAX_RUNS
    outs = []
    for max_runs in (0, 100):  # indexed, then run by run
        monkeypatch.setattr(copies, "MAX_RUNS", max_runs)
        out = torch.empty(len(pages), 2 * kv.layout.num_layers, kv.layout.page_size, 2,
                          kv.layout.head_dim)
        copies.gather(kv.layers, pages, slice(1, 3), out)
        outs.append(out)
        dst = RankKV(0, 1, 3)
        copies.scatter(dst.layers, pages[::-1].copy(), slice(0, 2), out)
        np.testing.assert_array_equal(dst.dump(pages[::-1])[..., :2, :],
                                      kv.dump(pages)[..., 1:3, :])
    assert torch.equal(outs[0], outs[1])
