"""P and D KV managers in separate processes on loopback: transfer, crashes, restarts."""

from __future__ import annotations

import time

import numpy as np
import pytest
from pd_disagg_util import FAST_ENV, Remote, TestKV, decode, free_port, make_env, prefill, wait_for

from pdcore.disagg.states import KVPoll

HB = float(FAST_ENV["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"])
HB_MAX = int(FAST_ENV["SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"])


@pytest.fixture
def cleanup():
    things = []
    yield things
    for t in reversed(things):
        (t.kill if isinstance(t, Remote) else t.close)()


def transfer(p: Remote, d, dkv: TestKV, port: int, room: int, src, dst) -> int:
    p("add", room)
    d.add(room, "127.0.0.1", port)
    wait_for(lambda room=room: d.poll(room) == KVPoll.WaitingForInput, what="D resolved P")
    slot = dkv.aux.alloc()
    d.send_transfer_info(room, np.array(dst), slot)
    wait_for(lambda room=room: p("poll", room) == KVPoll.WaitingForInput, what="P got pages")
    assert p("dest_pages", room) == len(dst)
    p("write_aux", 1, room, 99)
    half = len(src) // 2
    p("send", room, src[:half], 0, False, None)
    p("send", room, src[half:], half, True, 1)
    wait_for(lambda room=room: d.poll(room) in (KVPoll.Success, KVPoll.Failed), what="D done")
    assert d.poll(room) == KVPoll.Success, d.failure_reason(room)
    wait_for(lambda room=room: p("poll", room) == KVPoll.Success, what="P done")
    return slot


def test_cross_process_transfer_then_prefill_crash_and_restart(cleanup) -> None:
    port = free_port()
    p = Remote("prefill", port, seed=1)
    cleanup.append(p)
    dkv = TestKV()
    d = decode(dkv, make_env())
    cleanup.append(d)

    src, dst = [2, 3, 4, 9], [0, 1, 17, 18]
    slot = transfer(p, d, dkv, port, 1001, src, dst)
    np.testing.assert_array_equal(dkv.dump(dst), p("dump", src))
    assert dkv.all_zero_except(dst)
    row = dkv.aux.read(slot)
    assert (row.room, row.first_token_id, row.top_ids, row.prompt_tokens) == (1001, 99, (99, 7), 11)
    assert p("metrics")["transfers"] == 1

    # P dies while D waits for a room's KV: D fails it within interval x max failures + slack
    p("add", 1002)
    d.add(1002, "127.0.0.1", port)
    wait_for(lambda: d.poll(1002) == KVPoll.WaitingForInput)
    d.send_transfer_info(1002, np.array([5, 6]), dkv.aux.alloc())
    p.kill()
    t0 = time.monotonic()
    wait_for(lambda: d.poll(1002) == KVPoll.Failed, timeout=HB * (HB_MAX + 1) + 5,
             what="heartbeat fails the room")
    assert "lost connection with prefill instance" in d.failure_reason(1002)
    assert time.monotonic() - t0 <= HB * (HB_MAX + 1) + 3
    assert d.metrics()["prefill_instances"] == 0

    # a restarted P on the same bootstrap port serves a new room; D was never restarted
    p2 = Remote("prefill", port, seed=2)
    cleanup.append(p2)
    transfer(p2, d, dkv, port, 1003, [7], [25])
    np.testing.assert_array_equal(dkv.dump([25]), p2("dump", [7]))
    assert d.metrics()["registrations"] == 2


def test_decode_crash_fails_prefill_rooms(cleanup) -> None:
    port = free_port()
    pkv = TestKV(seed=4)
    p = prefill(pkv, port, make_env(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="3",
                                    SGLANG_DISAGGREGATION_WAITING_TIMEOUT="3"))
    cleanup.append(p)
    d = Remote("decode", port)
    cleanup.append(d)
    for room in (1, 2, 3):
        p.add(room)
    for room in (1, 2):
        d("add", room, "127.0.0.1", port)
        wait_for(lambda room=room: d("poll", room) == KVPoll.WaitingForInput)
        d("send_transfer_info", room, [room, room + 10], room)
        wait_for(lambda room=room: p.poll(room) == KVPoll.WaitingForInput)
    d.kill()
    t0 = time.monotonic()
    p.send(1, np.array([0, 1]), 0, True, None)  # write into the dead D fails fast ...
    wait_for(lambda: p.poll(1) == KVPoll.Failed, timeout=10)
    assert "decode" in p.failure_reason(1) and "failed" in p.failure_reason(1)
    # ... and drops its session: D's other room fails too, without any send
    wait_for(lambda: p.poll(2) == KVPoll.Failed, timeout=5)
    # room 3 never got pages from D: the bootstrap timeout frees it
    wait_for(lambda: p.poll(3) == KVPoll.Failed, timeout=6)
    assert "bootstrap timeout" in p.failure_reason(3)
    assert time.monotonic() - t0 < 6
    m = p.metrics()
    assert m["session_failures"] == 1 and m["sessions"] == 0, m
