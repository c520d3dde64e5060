"""Real prefill and decode KV managers (every TP rank, tcp backend) moving KV through the
staging planner: D's pages hold exactly the model's heads it owns, for P TP > D TP, P TP <
D TP, uneven head splits and GQA replication; equal TP bypasses staging; an oversize chunk
fails only its room; a full ring makes a room wait, not fail; one side without staging falls
back to the per-head slice path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from staging_util import RankKV, decode, env, free_port, prefill, truth, wait_for

from pdcore.disagg.aux import AuxRow
from pdcore.disagg.states import KVPoll

SRC = [3, 4, 5, 9, 10, 11, 12]
DST = [20, 21, 22, 30, 31, 2, 3]
SEED = 5


class Pair:
    """Every rank of one P and one D instance on loopback."""

    def __init__(self, p_tp: int, d_tp: int, heads: int, p_env: dict | None = None,
                 d_env: dict | None = None) -> None:
        self.port = free_port()
        self.pkv = [RankKV(r, p_tp, heads, seed=SEED) for r in range(p_tp)]
        self.dkv = [RankKV(r, d_tp, heads) for r in range(d_tp)]
        self.ps = [prefill(k, self.port, env(**(p_env or {}))) for k in self.pkv]
        self.ds = [decode(k, env(**(d_env or {}))) for k in self.dkv]
        self.heads = heads

    def start(self, room: int, dst: list[int] = DST) -> list[int]:
        for p in self.ps:
            p.add(room)
        for d in self.ds:
            d.add(room, "127.0.0.1", self.port)
        wait_for(lambda: all(d.poll(room) >= KVPoll.WaitingForInput for d in self.ds))
        slots = [k.aux.alloc() for k in self.dkv]
        for d, s in zip(self.ds, slots):
            d.send_transfer_info(room, np.array(dst), s)
        return slots

    def push(self, room: int, src: list[int] = SRC, split: int = 3) -> None:
        wait_for(lambda: all(p.poll(room) != KVPoll.Bootstrapping for p in self.ps),
                 what="every P rank got its TransferInfos")
        for p, k in zip(self.ps, self.pkv):
            s = k.aux.alloc()
            k.aux.write(s, AuxRow(room=room, first_token_id=7))
            p.send(room, np.array(src[:split]), 0, False, None)
            p.send(room, np.array(src[split:]), split, True, s)

    def finish(self, room: int) -> list[KVPoll]:
        wait_for(lambda: all(d.poll(room) in (KVPoll.Success, KVPoll.Failed) for d in self.ds))
        return [d.poll(room) for d in self.ds]

    def check_pages(self, src: list[int] = SRC, dst: list[int] = DST) -> None:
        for k in self.dkv:
            want = truth(self.heads, SEED, src, k.first, k.layout.kv_heads)
            np.testing.assert_array_equal(k.dump(dst), want)

    def metric(self, side: str, name: str) -> int:
        mgrs = self.ps if side == "p" else self.ds
        return sum(int(m.metrics().get(name, 0)) for m in mgrs)

    def close(self) -> None:
        for m in self.ds + self.ps[::-1]:
            m.close()


@pytest.mark.parametrize("p_tp,d_tp,heads", [
    (2, 1, 2), (1, 2, 2),  # the two directions
    (2, 1, 3), (1, 2, 3),  # uneven: 3 KV heads split 1 + 2
    (4, 2, 4), (1, 4, 2),  # wider, and D TP > KV heads (replicated heads on D)
])
def test_staged_transfer_lands_every_head(p_tp, d_tp, heads):
    pair = Pair(p_tp, d_tp, heads)
    try:
        slots = pair.start(100)
        pair.push(100)
        assert pair.finish(100) == [KVPoll.Success] * d_tp, [
            d.failure_reason(100) for d in pair.ds]
        pair.check_pages()
        assert all(k.aux.read(s).first_token_id == 7 for k, s in zip(pair.dkv, slots))
        assert pair.metric("p", "staged_bytes") > 0 and pair.metric("p", "direct_bytes") == 0
        assert pair.metric("d", "staged_rooms") == d_tp
        for d in pair.ds:
            d.release(100)
        assert all(d.grants.staging.alloc.used_bytes == 0 for d in pair.ds)  # grant freed
    finally:
        pair.close()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 2), (2, 4)])  # (2, 4): D's replicas line up too
def test_heads_that_line_up_bypass_staging(p_tp, d_tp):
    pair = Pair(p_tp, d_tp, 2)
    try:
        pair.start(1)
        pair.push(1)
        assert pair.finish(1) == [KVPoll.Success] * d_tp
        pair.check_pages()
        assert pair.metric("p", "staged_bytes") == 0 and pair.metric("p", "direct_bytes") > 0
        assert pair.metric("d", "staging_grants") == 0
    finally:
        pair.close()


def test_oversize_chunk_fails_only_its_room():
    # 1 MiB buffers; one P rank's slice of a token is 2*3 layers*1 head*8 dims*4 B = 192 B, so a
    # 64-page (256-token) chunk fits and a bigger prompt in one chunk does not
    pair = Pair(2, 1, 2, p_env={"SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "1"},
                d_env={"SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "8"})
    big = list(range(64))
    try:
        pair.start(1, dst=big)
        pair.push(1, src=big, split=0)
        assert pair.finish(1) == [KVPoll.Success]  # 256 tokens * 192 B = 48 KiB: fits
        for p in pair.ps:  # shrink P's buffers (below 48 KiB) to force an oversize chunk
            p.staging.buffer_bytes = 32 * 1024
        pair.start(2, dst=big)
        pair.push(2, src=big, split=0)
        assert pair.finish(2) == [KVPoll.Failed]
        assert "staging buffer" in pair.ds[0].failure_reason(2)
        pair.start(3)  # a normal room right after is fine
        pair.push(3)
        assert pair.finish(3) == [KVPoll.Success]
        pair.check_pages()
    finally:
        pair.close()


def test_room_larger_than_ring_fails_cleanly():
    pair = Pair(1, 2, 2, d_env={"SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "1"})
    try:
        for d in pair.ds:  # a ring smaller than one room's grant (7 pages: 5376 B)
            d.grants.staging.region = dataclasses.replace(d.grants.staging.region, length=1000)
        pair.start(5)
        assert pair.finish(5) == [KVPoll.Failed, KVPoll.Failed]
        assert "SGLANG_DISAGG_STAGING_POOL_SIZE_MB" in pair.ds[0].failure_reason(5)
    finally:
        pair.close()


def test_full_ring_makes_rooms_wait_in_order():
    pair = Pair(2, 1, 2)
    ring = pair.ds[0].grants.staging
    try:
        hog = ring.reserve(ring.region.length - 1024)  # leave less than one room's grant
        assert hog is not None
        pair.start(1)
        wait_for(lambda: pair.ds[0].metrics()["staging_waiting_rooms"] == 1, what="room waits")
        assert all(p.poll(1) == KVPoll.Bootstrapping for p in pair.ps)  # no TransferInfo yet
        ring.free(hog)
        pair.push(1)
        assert pair.finish(1) == [KVPoll.Success]
        pair.check_pages()
    finally:
        pair.close()


@pytest.mark.parametrize("side", ["p", "d"])
def test_one_side_without_staging_uses_the_slice_path(side):
    off = {"SGLANG_DISAGG_STAGING_BUFFER": "0"}
    pair = Pair(2, 1, 2, p_env=off if side == "p" else None, d_env=off if side == "d" else None)
    try:
        pair.start(1)
        pair.push(1)
        assert pair.finish(1) == [KVPoll.Success]
        pair.check_pages()
        assert pair.metric("p", "staged_bytes") == 0
    finally:
        pair.close()
