"""Different TP sizes on P and D: rank mapping, head slices, every required rank agrees."""

from __future__ import annotations

import numpy as np
import pytest
from pd_disagg_util import TestKV, decode, free_port, make_env, prefill, wait_for

from pdcore.disagg.aux import AuxRow
from pdcore.disagg.states import KVPoll
from pdcore.errors import ProtocolError
from pdcore.interfaces.geometry import kv_head_span, rank_mapping
from pdcore.interfaces.planner import KVLayout

SRC, DST = [0, 1, 5], [7, 8, 2]


def logical(pkvs: list[TestKV], total: int) -> np.ndarray:
    parts = [k.dump(SRC) for k in pkvs]
    full = np.zeros(parts[0].shape[:-2] + (total, parts[0].shape[-1]), np.float32)
    for k, part in zip(pkvs, parts):
        first, n = k.layout.head_span
        full[..., first:first + n, :] = part
    return full


@pytest.mark.parametrize("p_tp,d_tp,heads", [(2, 1, 2), (1, 2, 2), (1, 4, 2), (4, 2, 4)])
def test_hetero_tp_transfer(p_tp: int, d_tp: int, heads: int) -> None:
    port, env, room = free_port(), make_env(), 4242
    pkvs = [TestKV(seed=3, tp_rank=r, tp_size=p_tp, total_heads=heads) for r in range(p_tp)]
    dkvs = [TestKV(tp_rank=r, tp_size=d_tp, total_heads=heads) for r in range(d_tp)]
    ps = [prefill(k, port, env, tp_rank=r, tp_size=p_tp) for r, k in enumerate(pkvs)]
    ds = [decode(k, env, tp_rank=r, tp_size=d_tp) for r, k in enumerate(dkvs)]
    try:
        for p in ps:
            p.add(room)
        for d in ds:
            d.add(room, "127.0.0.1", port)
        wait_for(lambda: all(d.poll(room) == KVPoll.WaitingForInput for d in ds))
        slots = [k.aux.alloc() for k in dkvs]
        for d, s in zip(ds, slots):
            d.send_transfer_info(room, np.array(DST), s)
        wait_for(lambda: all(p.poll(room) == KVPoll.WaitingForInput for p in ps),
                 what="every P rank got all its TransferInfos")
        for p, k in zip(ps, pkvs):
            s = k.aux.alloc()
            k.aux.write(s, AuxRow(room=room, first_token_id=5))
            p.send(room, np.array(SRC), 0, True, s)
        wait_for(lambda: all(d.poll(room) in (KVPoll.Success, KVPoll.Failed) for d in ds))
        assert [d.poll(room) for d in ds] == [KVPoll.Success] * d_tp, [
            d.failure_reason(room) for d in ds]
        full = logical(pkvs, heads)
        for k, s in zip(dkvs, slots):
            first, n = k.layout.head_span
            np.testing.assert_array_equal(k.dump(DST), full[..., first:first + n, :])
            assert k.all_zero_except(DST)
            assert k.aux.read(s).first_token_id == 5
    finally:
        for m in ds + ps[::-1]:
            m.close()


def test_rank_mapping() -> None:
    assert rank_mapping(2, 2, 1, False) == ([1], 1, 1)
    assert rank_mapping(1, 4, 3, False) == ([0], 4, 1)
    assert rank_mapping(4, 2, 1, False) == ([2, 3], 1, 2)
    assert rank_mapping(2, 1, 0, True) == ([0, 1], 1, 2)  # MLA: P rank 0 writes, 1 plans nothing
    with pytest.raises(ProtocolError, match="multiple"):
        rank_mapping(3, 2, 0, False)


def _layout(kv_heads: int, tp_rank: int, tp_size: int, total: int) -> KVLayout:
    return KVLayout(num_layers=1, page_size=4, kv_heads=kv_heads, head_dim=8, elem_size=4,
                    k_bases=(0,), v_bases=(0,), num_pages=4, tp_rank=tp_rank, tp_size=tp_size,
                    total_kv_heads=total)


def test_layout_head_span_follows_the_engine_split() -> None:
    got = {(total, tp): [_layout(kv_head_span(total, r, tp)[1], r, tp, total).head_span
                         for r in range(tp)] for total, tp in [(3, 2), (2, 4), (4, 2)]}
    assert got == {(3, 2): [(0, 1), (1, 2)],  # uneven floor split
                   (2, 4): [(0, 1), (0, 1), (1, 1), (1, 1)],  # GQA replicas
                   (4, 2): [(0, 2), (2, 2)]}
    unknown = _layout(2, 1, 2, 0)  # total not given: every rank holds its own heads
    assert unknown.model_kv_heads == 4 and unknown.head_span == (2, 2)
