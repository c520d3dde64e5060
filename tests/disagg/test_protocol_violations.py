"""Protocol violations by a scheduler fail the ROOM on both sides, never raise into the engine:
send() after the last chunk or out of turn, send_transfer_info() twice, a duplicate room.
Real prefill and decode KV managers on loopback (tcp); a clean room afterwards still works."""

from __future__ import annotations

import numpy as np
import pytest
from pd_disagg_util import TestKV, decode, free_port, make_env, prefill, wait_for
from test_managers import PD, run_room

from pdcore.disagg.states import KVPoll


@pytest.fixture
def pair():
    port = free_port()
    pkv, dkv = TestKV(seed=1), TestKV()
    p = prefill(pkv, port, make_env(), "tcp")
    d = decode(dkv, make_env(), "tcp")
    yield PD(pkv, p, dkv, d, port)
    d.close()
    p.close()


def _ready(s: PD, room: int, dst: list[int]) -> int:
    """Both sides past the handshake: P knows D's pages (WaitingForInput)."""
    s.p.add(room)
    s.d.add(room, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(room) == KVPoll.WaitingForInput, what="decode resolved prefill")
    slot = s.dkv.aux.alloc()
    s.d.send_transfer_info(room, np.array(dst), slot)
    wait_for(lambda: s.p.poll(room) == KVPoll.WaitingForInput, what="prefill got pages")
    return slot


def _both_failed(s: PD, room: int, why: str) -> None:
    wait_for(lambda: s.p.poll(room) == KVPoll.Failed, what="prefill room failed")
    wait_for(lambda: s.d.poll(room) == KVPoll.Failed, what="decode room failed")
    assert why in s.p.failure_reason(room) or why in s.d.failure_reason(room)


def _still_serves(s: PD, room: int) -> None:
    run_room(s, room, [1, 2, 3], [4, 5, 6])


def test_send_after_last_chunk_fails_the_room(pair: PD) -> None:
    _ready(pair, 1, [4, 5, 6])
    p_slot = pair.pkv.aux.alloc()
    pair.p.send(1, np.array([1, 2, 3]), 0, True, p_slot)
    pair.p.send(1, np.array([1]), 0, True, p_slot)  # a second "last" chunk: no exception
    _both_failed(pair, 1, "send() after the last chunk")
    pair.p.release(1)
    pair.d.release(1)
    _still_serves(pair, 2)


def test_send_before_destination_pages_fails_the_room(pair: PD) -> None:
    pair.p.add(3)
    pair.p.send(3, np.array([1, 2]), 0, False, None)  # still Bootstrapping
    assert pair.p.poll(3) == KVPoll.Failed
    assert "send() in state Bootstrapping" in pair.p.failure_reason(3)
    pair.p.send(99, np.array([1]), 0, True, None)  # a room never added: logged, no exception
    assert pair.p.poll(99) == KVPoll.Failed
    _still_serves(pair, 4)


def test_second_transfer_info_fails_the_room(pair: PD) -> None:
    slot = _ready(pair, 5, [4, 5, 6])
    pair.d.send_transfer_info(5, np.array([7, 8, 9]), slot)  # in state Transferring
    _both_failed(pair, 5, "send_transfer_info() in state Transferring")
    pair.d.send_transfer_info(5, np.array([7]), slot)  # after the failure: ignored
    pair.d.send_transfer_info(12345, np.array([7]), slot)  # never added: ignored
    pair.d.send_transfer_info(6, np.array([10**9]), slot)  # bad pages, never added: ignored
    _still_serves(pair, 7)


def test_duplicate_room_fails_it_on_both_sides(pair: PD) -> None:
    _ready(pair, 8, [4, 5, 6])
    pair.p.add(8)  # a second request on the same room
    pair.d.add(8, "127.0.0.1", pair.port)
    _both_failed(pair, 8, "already in use by another request")
    pair.p.release(8)
    pair.d.release(8)
    _still_serves(pair, 9)
