"""Different TP sizes on P and D: rank mapping, head slices, every required rank agrees."""

from __future__ import annotations

import numpy as np
import pytest
from pd_disagg_util import TestKV, decode, free_port, make_env, prefill, wait_for

from pdcore.builtin.planner import owned_heads
from pdcore.disagg.aux import AuxRow
from pdcore.disagg.decode import rank_mapping
from pdcore.disagg.states import KVPoll
from pdcore.errors import ProtocolError

SRC, DST = [0, 1, 5], [7, 8, 2]


def logical(pkvs: list[TestKV], total: int) -> np.ndarray:
    parts = [k.dump(SRC) for k in pkvs]
    full = np.zeros(parts[0].shape[:-2] + (total, parts[0].shape[-1]), np.float32)
    for k, part in zip(pkvs, parts):
        first, n = owned_heads(k.layout)
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
            first, n = owned_heads(k.layout)
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
    with pytest.raises(ProtocolError, match="MLA"):
        rank_mapping(2, 1, 0, True)
    with pytest.raises(ProtocolError, match="multiple"):
        rank_mapping(3, 2, 0, False)
