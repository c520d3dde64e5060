"""MLA KV transfer between any TP sizes: rank mapping + default planner, executed with memmove
over real latent pools (KVCache with is_mla: one buffer per layer, v_bases == k_bases)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdcore.builtin.planner import DefaultPlanner
from pdcore.engine.kv.cache import KVCache
from pdcore.interfaces.geometry import mla_sender, rank_mapping
from pdcore.interfaces.memory import PoolContext
from pdcore.plugins.host import memory_pools

LAYERS, PAGES, PAGE, LATENT = 3, 10, 4, 40
SRC = np.array([1, 2, 3, 7, 8, 0])
DST = np.array([4, 5, 6, 9, 1, 2])


def _pool(tp_rank: int, tp_size: int, fill: bool) -> KVCache:
    pool = memory_pools().create("torch", PoolContext(rank=tp_rank))
    kv = KVCache(pool, LAYERS, PAGES, PAGE, 1, LATENT, dtype=torch.float32,
                 tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=1,
                 is_mla=True)
    for k, _ in kv.layers:
        if fill:  # the latent is the same on every P rank: seed by layer only
            k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(k.numel())))
        else:
            k.zero_()
    return kv


def _execute(batch) -> int:
    for s, d, n in zip(batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()):
        ctypes.memmove(d, s, n)
    return int(batch.length.sum()) if len(batch) else 0


def test_latent_pool_has_one_buffer_per_layer():
    kv = _pool(0, 1, False)
    lay = kv.layout()
    assert lay.is_mla and lay.v_bases == lay.k_bases and len(kv.regions()) == LAYERS
    assert lay.item_len == PAGE * LATENT * 4
    assert lay.page_bytes == LAYERS * PAGE * LATENT * 4
    assert KVCache.bytes_per_token(LAYERS, 1, LATENT, torch.float32, is_mla=True) == \
        LAYERS * LATENT * 4  # half of what K + V buffers of one head would take


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (3, 2), (2, 3)])
def test_every_decode_rank_gets_the_latent_once_and_every_prefill_rank_is_asked(p_tp, d_tp):
    p = [_pool(r, p_tp, True) for r in range(p_tp)]
    d = [_pool(r, d_tp, False) for r in range(d_tp)]
    planner = DefaultPlanner()
    asked: dict[int, list[int]] = {}  # P rank -> the required counts D ranks send it
    for dr in range(d_tp):
        targets, required, responses = rank_mapping(p_tp, d_tp, dr, True)
        assert responses == len(targets)
        written = 0
        for t in targets:
            asked.setdefault(t, []).append(required)
            src, dst = p[t].layout(), d[dr].layout()
            assert planner.supports(src, dst) == (True, "")
            n = _execute(planner.plan(src, dst, SRC, DST))
            assert (n > 0) == mla_sender(t, p_tp, dr)
            written += n
        # one latent per token and layer, written by exactly one P rank: no V, no duplicates
        assert written == len(SRC) * PAGE * LAYERS * LATENT * 4
        for (pk, _), (dk, _) in zip(p[0].layers, d[dr].layers):
            assert torch.equal(dk[DST], pk[SRC])
            others = np.setdiff1d(np.arange(PAGES), DST)
            assert not dk[others].any()
    # every P rank has a destination (else its room waits for one until the bootstrap
    # timeout), and as many as the D ranks that name it say
    assert sorted(asked) == list(range(p_tp))
    for counts in asked.values():
        assert counts == [len(counts)] * len(counts)
