"""D meets a new prefill instance id at a known address (P restarted on the same port).

Rooms the old instance cannot have started on move to the new instance and succeed there;
a room the old instance had started on fails at once with "restarted", and releasing it
leaves nothing held. Real P and D KV managers, tcp backend, loopback."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pd_disagg_util import TestKV, decode, free_port, make_env, prefill, wait_for

from pdcore.disagg.aux import AuxRow
from pdcore.disagg.prefill import PrefillKVManager
from pdcore.disagg.states import KVPoll

ROW = AuxRow(room=0, first_token_id=7)
# a fast heartbeat that never declares P lost during the test: only the restart verdict acts
D_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.2",
         "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "100"}


def _serve(p: PrefillKVManager, pkv: TestKV, room: int, src: list[int]) -> None:
    """P side of one room once D's pages arrived: all KV in one chunk plus the aux row."""
    wait_for(lambda: p.poll(room) == KVPoll.WaitingForInput, what=f"prefill got room {room}")
    slot = pkv.aux.alloc()
    pkv.aux.write(slot, dataclasses.replace(ROW, room=room))
    p.send(room, np.array(src), 0, True, slot)


@pytest.fixture
def managers():
    made = []
    yield made
    for m in reversed(made):
        m.close()


def test_restart_moves_unserved_rooms_and_fails_started_ones(managers) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    pkv, dkv = TestKV(seed=1), TestKV()
    p = prefill(pkv, port, make_env())
    d = decode(dkv, make_env(**D_ENV))
    managers += [d, p]
    # room 1 is served by the old instance: D knows (and is registered with) it
    p.add(1)
    d.add(1, "127.0.0.1", port)
    wait_for(lambda: d.poll(1) == KVPoll.WaitingForInput, what="decode resolved prefill")
    d.send_transfer_info(1, np.array([1]), dkv.aux.alloc())
    _serve(p, pkv, 1, [2])
    wait_for(lambda: d.poll(1) == KVPoll.Success, what="room 1 received")
    old_id = d.prefills.get(addr).instance_id
    # room 2: its pages reached the old instance, which has started on it
    p.add(2)
    d.add(2, "127.0.0.1", port)
    wait_for(lambda: d.poll(2) == KVPoll.WaitingForInput, what="old prefill confirmed room 2")
    d.send_transfer_info(2, np.array([5, 6]), dkv.aux.alloc())
    wait_for(lambda: p.poll(2) == KVPoll.WaitingForInput, what="old prefill got room 2")
    # room 4: confirmed by the old instance, its pages sent only once that one is dead
    p.add(4)
    d.add(4, "127.0.0.1", port)
    wait_for(lambda: d.poll(4) == KVPoll.WaitingForInput, what="old prefill confirmed room 4")
    p.ctrl.close()  # dies without its "shutting down" notice, as under kill -9
    p.close()
    wait_for(lambda: d.heartbeat.down_since(addr) is not None, what="heartbeat sees P down")
    # room 3 arrives while P is down: D still holds the old instance, whose confirmation
    # never comes (no page reserved); room 4's pages go to the old (dead) instance
    d.add(3, "127.0.0.1", port)
    assert d.poll(3) == KVPoll.Bootstrapping
    d.send_transfer_info(4, np.array([8, 9]), dkv.aux.alloc())
    assert d.poll(4) == KVPoll.Transferring
    pkv2 = TestKV(seed=9)
    p2 = prefill(pkv2, port, make_env())  # a new instance behind the same bootstrap port
    managers.append(p2)
    p2.add(3)
    p2.add(4)
    wait_for(lambda: d.poll(2) == KVPoll.Failed, what="started room fails")
    assert "restarted" in d.failure_reason(2) and d.peer_fault(2)
    # #46: the reason is recorded as such (D answers error code peer_restarted, which the
    # router reads); a room failed for another peer fault is not a restart
    assert d.restart_fault(2) and not d.restart_fault(4)
    wait_for(lambda: addr in d.prefills.instances() and d.prefills.get(addr).instance_id != old_id,
             what="decode resolved the new instance")
    # room 4 got its pages to the new instance again; room 3 goes on as a fresh room would
    _serve(p2, pkv2, 4, [3, 4])
    wait_for(lambda: d.poll(4) in (KVPoll.Success, KVPoll.Failed), what="room 4 done")
    assert d.poll(4) == KVPoll.Success, d.failure_reason(4)
    np.testing.assert_array_equal(dkv.dump([8, 9]), pkv2.dump([3, 4]))
    wait_for(lambda: d.poll(3) != KVPoll.Bootstrapping, what="the new instance confirmed room 3")
    assert d.poll(3) == KVPoll.WaitingForInput, d.failure_reason(3)
    d.send_transfer_info(3, np.array([11]), dkv.aux.alloc())
    _serve(p2, pkv2, 3, [1])
    wait_for(lambda: d.poll(3) in (KVPoll.Success, KVPoll.Failed), what="room 3 done")
    assert d.poll(3) == KVPoll.Success, d.failure_reason(3)
    np.testing.assert_array_equal(dkv.dump([11]), pkv2.dump([1]))
    assert dkv.all_zero_except([1, 8, 9, 11])  # the failed room's pages got nothing
    m = d.metrics()
    assert m["prefill_restarts"] == 1 and m["rooms_moved_after_restart"] == 2
    for room in (1, 2, 3, 4):
        d.release(room)
    wait_for(lambda: p2.poll(3) == KVPoll.Success and p2.poll(4) == KVPoll.Success)
    p2.release(3)
    p2.release(4)
    assert d.metrics()["inflight_rooms"] == 0 and p2.metrics()["inflight_rooms"] == 0


def test_restart_seen_before_any_failed_check_fails_sent_rooms(managers) -> None:
    """Without a failed heartbeat in between, D cannot know the old instance never got the
    room's pages: it fails the room (bounded, nothing held) rather than guess; a room not
    sent yet still moves."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    pkv, dkv = TestKV(seed=1), TestKV()
    p = prefill(pkv, port, make_env())
    d = decode(dkv, make_env(**{**D_ENV, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1.0"}))
    managers += [d, p]
    for room in (1, 2):
        p.add(room)
        d.add(room, "127.0.0.1", port)
    wait_for(lambda: d.poll(1) == d.poll(2) == KVPoll.WaitingForInput, what="resolved")
    d.send_transfer_info(1, np.array([1]), dkv.aux.alloc())
    wait_for(lambda: p.poll(1) == KVPoll.WaitingForInput, what="old prefill got room 1")
    p.ctrl.close()
    p.close()
    pkv2 = TestKV(seed=9)
    p2 = prefill(pkv2, port, make_env())
    managers.append(p2)
    p2.add(2)
    wait_for(lambda: d.poll(1) == KVPoll.Failed, what="sent room fails")
    assert "restarted" in d.failure_reason(1)
    assert d.heartbeat.down_since(addr) is None
    wait_for(lambda: d.metrics().get("rooms_moved_after_restart") == 1, what="room 2 moved")
    wait_for(lambda: d.poll(2) == KVPoll.WaitingForInput and d._rooms[2].inst is
             d.prefills.get(addr), what="room 2 on the new instance")
    d.send_transfer_info(2, np.array([4]), dkv.aux.alloc())
    _serve(p2, pkv2, 2, [6])
    wait_for(lambda: d.poll(2) in (KVPoll.Success, KVPoll.Failed), what="room 2 done")
    assert d.poll(2) == KVPoll.Success, d.failure_reason(2)
    np.testing.assert_array_equal(dkv.dump([4]), pkv2.dump([6]))
    d.release(1)
    d.release(2)
    assert d.metrics()["inflight_rooms"] == 0
