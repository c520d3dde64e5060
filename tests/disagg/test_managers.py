"""Prefill and decode KV managers in one process, real tcp backend and sockets on loopback."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import numpy as np
import pytest
from pd_disagg_util import (
    TestKV,
    decode,
    free_port,
    make_env,
    prefill,
    wait_for,
)

from pdcore.disagg import wire
from pdcore.disagg.aux import AuxRow
from pdcore.disagg.common import FAKE_BOOTSTRAP_HOST, UNBOUNDED_PAGES
from pdcore.disagg.decode import DecodeKVManager
from pdcore.disagg.prefill import PrefillKVManager
from pdcore.disagg.states import KVPoll
from pdcore.route_refusal import RefusalNotifier

ROW = AuxRow(room=0, first_token_id=42, logprob=-0.25, top_ids=(42, 3), top_logprobs=(-0.25, -3.0),
             cached_tokens=2, prompt_tokens=13)


@dataclasses.dataclass
class PD:
    pkv: TestKV
    p: PrefillKVManager
    dkv: TestKV
    d: DecodeKVManager
    port: int


@pytest.fixture
def pd():
    """(P kv, P manager, D kv, D manager, bootstrap port) on tcp; closed afterwards."""
    made = []

    def build(p_env=None, d_env=None, backend="tcp", p_token=None, d_token=None):
        port = free_port()
        pkv, dkv = TestKV(seed=1), TestKV()
        p = prefill(pkv, port, make_env(**(p_env or {})), backend, p_token)
        made.append(p)
        d = decode(dkv, make_env(**(d_env or {})), backend, d_token)
        made.append(d)
        return PD(pkv, p, dkv, d, port)

    yield build
    for m in reversed(made):
        m.close()


def run_room(s: PD, room, src, dst, chunks=2, p=None, pkv=None):
    p, pkv, dkv, d, port = p or s.p, pkv or s.pkv, s.dkv, s.d, s.port
    p.add(room)
    d.add(room, "127.0.0.1", port)
    wait_for(lambda room=room: d.poll(room) == KVPoll.WaitingForInput, what="decode resolved prefill")
    d_slot = dkv.aux.alloc()
    d.send_transfer_info(room, np.array(dst), d_slot)
    assert d.poll(room) == KVPoll.Transferring
    wait_for(lambda room=room: p.poll(room) == KVPoll.WaitingForInput, what="prefill got pages")
    assert p.dest_page_count(room) == len(dst)
    p_slot = pkv.aux.alloc()
    pkv.aux.write(p_slot, dataclasses.replace(ROW, room=room))
    bounds = np.linspace(0, len(src), chunks + 1).astype(int)
    for i in range(chunks):
        a, b = bounds[i], bounds[i + 1]
        p.send(room, np.array(src[a:b]), int(a), i == chunks - 1, p_slot if i == chunks - 1 else None)
    wait_for(lambda room=room: d.poll(room) in (KVPoll.Success, KVPoll.Failed), what="decode done")
    assert d.poll(room) == KVPoll.Success, d.failure_reason(room)
    wait_for(lambda room=room: p.poll(room) == KVPoll.Success, what="prefill success")
    return d_slot, p_slot


def test_same_tp_transfer_and_aux(pd):
    s = pd()
    src, dst = [0, 1, 2, 7, 8], [10, 11, 3, 4, 20]
    d_slot, _ = run_room(s, 77, src, dst)
    np.testing.assert_array_equal(s.dkv.dump(dst), s.pkv.dump(src))
    assert s.dkv.all_zero_except(dst)
    row = s.dkv.aux.read(d_slot)
    assert row.room == 77 and row.first_token_id == 42 and row.top_ids == (42, 3)
    assert row.top_logprobs == (-0.25, -3.0) and row.cached_tokens == 2
    m = s.p.metrics()
    assert m["transfers"] == 1 and m["chunks"] == 2 and m["bytes"] > 0
    assert s.d.metrics()["transfers"] == 1 and s.d.metrics()["registrations"] == 1
    # a second room reuses the cached topology and registration
    run_room(s, 78, [3], [30], chunks=1)
    assert s.d.metrics()["registrations"] == 1
    np.testing.assert_array_equal(s.dkv.dump([30]), s.pkv.dump([3]))


def test_decode_reserves_nothing_before_prefill_has_the_room(pd):
    """D claims a room when it admits the request and waits, holding no page, until P has the
    request too (issue 44 item 7): the scheduler sees WaitingForInput only then."""
    s = pd()
    s.d.add(5, "127.0.0.1", s.port)
    wait_for(lambda: 5 in s.p._pending, what="P got the claim")
    time.sleep(0.2)
    assert s.d.poll(5) == KVPoll.Bootstrapping  # the scheduler may not reserve pages yet
    s.p.add(5)  # the scheduler sees the request after D's claim arrived
    wait_for(lambda: s.d.poll(5) == KVPoll.WaitingForInput, what="P confirmed")
    s.d.send_transfer_info(5, np.array([1, 2]), s.dkv.aux.alloc())
    wait_for(lambda: s.p.poll(5) == KVPoll.WaitingForInput, what="P got the pages")
    assert s.p.dest_page_count(5) == 2


def test_unconfirmed_and_unclaimed_rooms_fail_fast(pd):
    """A room only D has (P never gets the request) fails after 6 claim timeouts, having held
    nothing; a room only P has (D refused its route) fails after one."""
    s = pd(p_env={"PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT": "0.3"},
           d_env={"PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT": "0.2"})
    s.d.add(6, "127.0.0.1", s.port)
    s.p.add(7)
    wait_for(lambda: s.p.poll(7) == KVPoll.Failed, what="P gave up on its unclaimed room")
    assert "no decode server claimed this room" in s.p.failure_reason(7)
    assert s.p.metrics()["unclaimed_rooms"] == 1
    wait_for(lambda: s.d.poll(6) == KVPoll.Failed, what="D gave up on its unconfirmed room")
    assert "prefill did not confirm this room" in s.d.failure_reason(6)
    assert s.d.metrics()["unconfirmed_rooms"] == 1


def test_a_flood_of_claims_is_capped_and_evicts_the_oldest(pd):
    """#44: P keeps what D sends for a room before P has its request (up to the cleanup
    interval, 120 s). A flood of claims for rooms that never come is capped per decode server
    and in all; the oldest entries go first, each failed on D at once (PENDING_EVICTED) and
    counted; real rooms, opened after the flood, are served."""
    s = pd()
    s.p._pending.per_peer, s.p._pending.total = 8, 12
    for room in range(100, 120):  # 20 orphans from the real D: its quota of 8 holds
        s.d.add(room, "127.0.0.1", s.port)
    wait_for(lambda: s.p.metrics().get("pending_evicted") == 12, what="D's own oldest evicted")
    kept = {r for r, _ in s.p._pending.items()}
    assert len(kept) == 8 and kept <= set(range(100, 120))
    gone = set(range(100, 120)) - kept
    wait_for(lambda: all(s.d.poll(r) == KVPoll.Failed for r in gone), what="D told at once")
    assert "too many rooms whose request it has not received" in s.d.failure_reason(min(gone))
    assert all(s.d.poll(r) == KVPoll.Bootstrapping for r in kept)
    # another decode server (forged claims on the wire) takes the rest of the table: the oldest
    # of all go (4 of D's), then its own oldest (200, 201) at its quota
    addr = next(iter(s.d.prefills.instances().values())).ctrl_addrs[(0, 0)]
    for i in range(10):
        s.d.ctrl.send(addr, wire.Claim(room=200 + i, session="h/evil/0/x",
                                       ctrl_addr=s.d.ctrl.addr, rank=0, decode_id="evil"))
    wait_for(lambda: s.p.metrics()["pending_evicted"] == 18, what="the table full")
    now = {r for r, _ in s.p._pending.items()}
    assert now >= set(range(202, 210)) and len(now & kept) == 4 and len(now) == 12
    assert s.p.metrics()["pending_rooms"] == 12
    wait_for(lambda: all(s.d.poll(r) == KVPoll.Failed for r in kept - now), what="D told")
    run_room(s, 300, [1, 2], [5, 6], chunks=1)  # real rooms are served, P first ...
    s.d.add(301, "127.0.0.1", s.port)  # ... or D first (its claim evicts the oldest)
    wait_for(lambda: 301 in s.p._pending, what="P has the claim")
    assert len(s.p._pending) == 12 and s.p.metrics()["pending_evicted"] == 19
    s.p.add(301)
    wait_for(lambda: s.d.poll(301) == KVPoll.WaitingForInput, what="P confirmed the room")


def test_a_refused_route_fails_the_unclaimed_room_at_once(pd):
    """Issue 45 item 6: a decode server that refused a route tells this host's prefill server
    (POST /refused on its bootstrap port, what D's HTTP edge sends): P fails the room at once
    (403, code route_refused), also one it adds only after the notice; a room a decode server
    claimed goes on, and a notice without the cluster secret's MAC changes nothing."""
    s = pd(p_env={"PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT": "30"}, p_token="k", d_token="k")
    tell, forger = RefusalNotifier("k"), RefusalNotifier("not the secret")
    try:
        s.p.add(11)
        assert tell.notify("127.0.0.1", s.port, 11, "the route is not trusted here")
        wait_for(lambda: s.p.poll(11) == KVPoll.Failed, timeout=5, what="P failed room 11")
        why = s.p.failure_reason(11)
        assert "decode refused this request's route (route_refused)" in why, why
        assert "the route is not trusted here" in why and s.p.route_refused(11)
        assert tell.notify("127.0.0.1", s.port, 12, "refused before P added it")
        wait_for(lambda: tell.counts["sent"] == 2, timeout=5, what="the second notice")
        s.p.add(12)
        assert s.p.poll(12) == KVPoll.Failed and "refused before" in s.p.failure_reason(12)
        s.d.add(13, "127.0.0.1", s.port)  # claimed: bound to this decode server
        s.p.add(13)
        wait_for(lambda: s.d.poll(13) == KVPoll.WaitingForInput, what="P confirmed room 13")
        s.p.add(14)
        assert tell.notify("127.0.0.1", s.port, 13, "a copied route another D refused")
        assert forger.notify("127.0.0.1", s.port, 14, "forged")
        wait_for(lambda: tell.counts["sent"] == 3 and forger.counts["sent"] == 1, timeout=5,
                 what="the notices for rooms 13 and 14")
        assert s.p.poll(13) != KVPoll.Failed and s.p.poll(14) != KVPoll.Failed
        assert s.p.metrics()["refused_rooms"] == 2 and not s.p.metrics().get("unclaimed_rooms")
    finally:
        tell.close()
        forger.close()


def test_out_of_range_page_fails_and_writes_nothing(pd):
    s = pd()
    s.p.add(9)
    s.d.add(9, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(9) == KVPoll.WaitingForInput)
    # a hostile / buggy TransferInfo straight onto the wire, bypassing D's own checks
    addr = next(iter(s.d.prefills.instances().values())).ctrl_addrs[(0, 0)]
    s.d.ctrl.send(addr, wire.TransferInfo(room=9, session=s.d.session, ctrl_addr=s.d.ctrl.addr, rank=0, decode_id=s.d.decode_id,
                                        dst_pages=np.array([1, 32], "<i4").tobytes(), aux_slot=0))
    wait_for(lambda: s.p.poll(9) == KVPoll.Failed, what="prefill rejects the pages")
    assert "outside decode's pool of 32 pages" in s.p.failure_reason(9)
    s.p.send(9, np.array([0, 1]), 0, True, None)  # failed room: a no-op, nothing is queued
    assert s.p.metrics().get("chunks", 0) == 0
    assert s.dkv.all_zero_except([])


def test_bad_aux_slot_fails(pd):
    s = pd()
    s.p.add(10)
    s.d.add(10, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(10) == KVPoll.WaitingForInput)
    addr = next(iter(s.d.prefills.instances().values())).ctrl_addrs[(0, 0)]
    s.d.ctrl.send(addr, wire.TransferInfo(room=10, session=s.d.session, ctrl_addr=s.d.ctrl.addr, rank=0, decode_id=s.d.decode_id,
                                        dst_pages=np.array([1], "<i4").tobytes(), aux_slot=99))
    wait_for(lambda: s.p.poll(10) == KVPoll.Failed)
    assert "aux slot 99" in s.p.failure_reason(10)


def test_chunk_beyond_reserved_pages_fails(pd):
    s = pd()
    s.p.add(11)
    s.d.add(11, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(11) == KVPoll.WaitingForInput)
    s.d.send_transfer_info(11, np.array([4, 5]), s.dkv.aux.alloc())
    wait_for(lambda: s.p.poll(11) == KVPoll.WaitingForInput)
    s.p.send(11, np.array([0, 1, 2]), 0, True, None)
    assert s.p.poll(11) == KVPoll.Failed and "exceed the 2 pages" in s.p.failure_reason(11)
    wait_for(lambda: s.d.poll(11) == KVPoll.Failed, what="decode told")
    assert s.dkv.all_zero_except([])


def test_wrong_token_rejected_nothing_written(pd):
    """D's Hello is MACed with another secret: P rejects it, never answers, so D never sends
    its Register (endpoint, KV addresses) and the room fails saying why."""
    s = pd(p_token="secret", d_token="wrong",
           d_env={"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1"})
    s.p.add(12)
    s.d.add(12, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(12) == KVPoll.Failed, timeout=20, what="D gives up on P")
    assert "did not prove" in s.d.failure_reason(12)
    assert s.p.metrics().get("rejected_messages", 0) >= 1  # the Hello
    assert s.p.poll(12) == KVPoll.Bootstrapping
    assert s.p.metrics()["sessions"] == 0 and s.p.metrics().get("received_messages", 0) == 0
    assert s.d.metrics().get("registrations", 0) == 0
    assert s.dkv.all_zero_except([])


def test_matching_token_works(pd):
    s = pd(p_token="secret", d_token="secret")
    run_room(s, 13, [1], [2], chunks=1)
    np.testing.assert_array_equal(s.dkv.dump([2]), s.pkv.dump([1]))


def test_bootstrap_timeout(pd):
    s = pd(p_env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "0.4"})
    s.p.add(14)
    assert s.p.poll(14) == KVPoll.Bootstrapping
    wait_for(lambda: s.p.poll(14) == KVPoll.Failed, timeout=5)
    assert "bootstrap timeout" in s.p.failure_reason(14)
    s.p.release(14)
    assert s.p.metrics()["inflight_rooms"] == 0


def test_decode_waiting_timeout_sends_abort(pd):
    s = pd(d_env={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "0.5"})
    s.p.add(15)
    s.d.add(15, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(15) == KVPoll.WaitingForInput)
    s.d.send_transfer_info(15, np.array([1]), s.dkv.aux.alloc())
    wait_for(lambda: s.d.poll(15) == KVPoll.Failed, timeout=5)  # P never sends (Transferring)
    assert "waiting timeout" in s.d.failure_reason(15)
    wait_for(lambda: s.p.poll(15) == KVPoll.Failed, what="abort reached prefill")
    assert "aborted by decode" in s.p.failure_reason(15)
    wait_for(lambda: s.d.metrics().get("abort_acks", 0) == 1, what="abort ack")


def test_abort_from_decode_and_from_prefill(pd):
    s = pd()
    for room in (16, 17):
        s.p.add(room)
        s.d.add(room, "127.0.0.1", s.port)
        wait_for(lambda room=room: s.d.poll(room) == KVPoll.WaitingForInput)
        s.d.send_transfer_info(room, np.array([room]), s.dkv.aux.alloc())
        wait_for(lambda room=room: s.p.poll(room) == KVPoll.WaitingForInput)
    s.d.abort(16, "client went away")
    wait_for(lambda: s.p.poll(16) == KVPoll.Failed)
    assert "client went away" in s.p.failure_reason(16)
    s.p.abort(17, "prompt too long")
    wait_for(lambda: s.d.poll(17) == KVPoll.Failed)
    assert "prompt too long" in s.d.failure_reason(17)
    # status only moves up, Failed stays; a late message does not resurrect released rooms
    s.d.release(17)
    assert s.d.poll(17) == KVPoll.Failed and "not known" in s.d.failure_reason(17)


def test_fake_bootstrap_host(pd):
    s = pd()
    s.p.add(0, FAKE_BOOTSTRAP_HOST)
    s.d.add(0, FAKE_BOOTSTRAP_HOST, s.port)
    assert s.p.poll(0) == KVPoll.WaitingForInput and s.d.poll(0) == KVPoll.WaitingForInput
    assert s.p.dest_page_count(0) == UNBOUNDED_PAGES and s.p.is_fake(0) and s.d.is_fake(0)
    slot = s.dkv.aux.alloc()
    s.d.send_transfer_info(0, np.array([1, 2]), slot)
    assert s.d.poll(0) == KVPoll.Success and s.dkv.aux.read(slot).room == 0
    s.p.send(0, np.array([0, 1]), 0, True, None)
    assert s.p.poll(0) == KVPoll.Success
    assert s.dkv.all_zero_except([]) and s.p.metrics().get("received_messages", 0) == 0


def test_fake_backend_runs_control_plane(pd):
    s = pd(backend="fake")
    d_slot, _ = run_room(s, 18, [0, 1], [5, 6])
    assert s.dkv.all_zero_except([])  # no KV moved
    assert s.dkv.aux.read(d_slot).first_token_id == 42  # aux row rode on the Status message


def test_unreachable_prefill_fails_bootstrap(pd):
    s = pd(d_env={"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.2"})
    dead = free_port()
    s.d.add(19, "127.0.0.1", dead)
    s.d.add(20, "127.0.0.1", dead)
    wait_for(lambda: s.d.poll(19) == KVPoll.Failed and s.d.poll(20) == KVPoll.Failed, timeout=8)
    assert "cannot bootstrap with prefill" in s.d.failure_reason(19)


def test_prefill_restart_on_same_port_is_picked_up(pd):
    s = pd()
    run_room(s, 30, [1], [2], chunks=1)
    s.p.add(31)
    s.d.add(31, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(31) == KVPoll.WaitingForInput)
    s.d.send_transfer_info(31, np.array([3]), s.dkv.aux.alloc())
    s.p.ctrl.close()  # P's control plane dies first: D gets no "shutting down" notice ...
    s.p.close()
    pkv2 = TestKV(seed=9)
    p2 = prefill(pkv2, s.port, make_env())  # a new instance behind the same bootstrap s.port
    try:
        wait_for(lambda: s.d.poll(31) == KVPoll.Failed, timeout=5, what="old room failed")
        # ... the heartbeat sees another instance id (or, if slower, no answer at all)
        assert any(w in s.d.failure_reason(31) for w in ("restarted", "lost connection"))
        run_room(s, 32, [4], [9], chunks=1, p=p2, pkv=pkv2)
        np.testing.assert_array_equal(s.dkv.dump([9]), pkv2.dump([4]))
    finally:
        p2.close()


def test_graceful_shutdown_tells_the_peer(pd):
    s = pd()
    s.p.add(40)
    s.d.add(40, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(40) == KVPoll.WaitingForInput)
    s.d.send_transfer_info(40, np.array([3]), s.dkv.aux.alloc())
    wait_for(lambda: s.p.poll(40) == KVPoll.WaitingForInput)
    s.d.close()
    wait_for(lambda: s.p.poll(40) == KVPoll.Failed, timeout=3)
    assert "decode server is shutting down" in s.p.failure_reason(40)


def _decode_with(layout_changes: dict, port_env=None) -> tuple[TestKV, DecodeKVManager]:
    dkv = TestKV()
    dkv.layout = dataclasses.replace(dkv.layout, **layout_changes)
    return dkv, decode(dkv, make_env(**(port_env or {})))


@pytest.mark.parametrize("changes,words", [({"dtype": "bfloat16"}, "dtype bfloat16"),
                                           ({"page_size": 8}, "page size 4")])
def test_page_size_or_dtype_mismatch_fails_clearly(pd, changes, words):
    s = pd()
    _, d = _decode_with(changes)
    try:
        s.p.add(50)
        d.add(50, "127.0.0.1", s.port)
        wait_for(lambda: d.poll(50) == KVPoll.Failed)
        assert words in d.failure_reason(50) and "same" in d.failure_reason(50)
        # never registered: P only hears D's Abort of the room, which fails it with the reason
        wait_for(lambda: s.p.poll(50) == KVPoll.Failed)
        assert words in s.p.failure_reason(50)
        assert s.p.metrics()["sessions"] == 0 and s.p.metrics()["pairing_refused"] == 1
        assert d.metrics()["pairing_refused"] == 1
    finally:
        d.close()


def test_layout_mismatch_fails_the_pairing_on_both_sides(pd):
    s = pd()
    _, d = _decode_with({"head_dim": 4})
    try:
        s.p.add(51)
        d.add(51, "127.0.0.1", s.port)
        wait_for(lambda: d.poll(51) == KVPoll.Failed)
        assert "head_dim=" in d.failure_reason(51)
        wait_for(lambda: s.p.poll(51) == KVPoll.Failed)
        assert "head_dim=" in s.p.failure_reason(51)
        assert s.p.metrics()["pairing_refused"] == 1 and s.p.metrics()["sessions"] == 0
    finally:
        d.close()


def test_registration_rejected_by_prefill_fails_the_room(pd):
    """A decode that skips its own checks (an older one) still cannot pair with another model:
    P refuses its Register, and the room fails on both sides with P's reason."""
    s = pd()
    dkv, d = _decode_with({})
    d.prefills.register = msgspec.structs.replace(d.prefills.register, model_fingerprint="0" * 16)
    try:
        s.p.add(52)
        d.add(52, "127.0.0.1", s.port)
        wait_for(lambda: d.poll(52) == KVPoll.WaitingForInput)
        d.send_transfer_info(52, np.array([1]), dkv.aux.alloc())
        wait_for(lambda: d.poll(52) == KVPoll.Failed)
        assert "another model" in d.failure_reason(52)
        assert s.p.poll(52) == KVPoll.Failed and "another model" in s.p.failure_reason(52)
        assert s.p.metrics()["rejected_registrations"] == 1
    finally:
        d.close()


def test_draft_head_on_one_side_only_fails_the_pairing(pd):
    """EAGLE on decode, none on prefill (#33): the draft layer counts differ, so the pairing is
    refused at resolution on D with words naming the flag, and P's room fails the same way;
    a D that skips its own check is refused by P at registration."""
    s = pd()
    dkv, d = _decode_with({"draft_layers": 1})
    try:
        s.p.add(53)
        d.add(53, "127.0.0.1", s.port)
        wait_for(lambda: d.poll(53) == KVPoll.Failed)
        why = d.failure_reason(53)
        assert "--speculative-algorithm" in why and "runs no draft head" in why, why
        wait_for(lambda: s.p.poll(53) == KVPoll.Failed)
        assert "--speculative-algorithm" in s.p.failure_reason(53)
        assert s.p.metrics()["pairing_refused"] == 1 and s.p.metrics()["sessions"] == 0
    finally:
        d.close()
    dkv, d = _decode_with({})
    d.prefills.register = msgspec.structs.replace(
        d.prefills.register, layout={**d.prefills.register.layout, "draft_layers": 1})
    try:
        s.p.add(54)
        d.add(54, "127.0.0.1", s.port)
        wait_for(lambda: d.poll(54) == KVPoll.WaitingForInput)
        d.send_transfer_info(54, np.array([1]), dkv.aux.alloc())
        wait_for(lambda: d.poll(54) == KVPoll.Failed)
        assert "--speculative-algorithm" in d.failure_reason(54)
        assert s.p.poll(54) == KVPoll.Failed
    finally:
        d.close()


def test_shm_backend_transfer():
    """Same flow over the `shm` backend: D's KV and aux rows live in named shared memory."""
    import uuid

    from pdcore.interfaces.memory import PoolContext
    from pdcore.plugins.host import memory_pools

    pools = [memory_pools().create("shm", PoolContext(server_id=uuid.uuid4().hex[:10]))
             for _ in range(2)]
    port = free_port()
    pkv, dkv = TestKV(seed=6, pool=pools[0]), TestKV(pool=pools[1])
    p = prefill(pkv, port, make_env(), "shm")
    d = decode(dkv, make_env(), "shm")
    try:
        slot, _ = run_room(PD(pkv, p, dkv, d, port), 60, [1, 2, 3, 9], [4, 5, 6, 0])
        np.testing.assert_array_equal(dkv.dump([4, 5, 6, 0]), pkv.dump([1, 2, 3, 9]))
        assert dkv.all_zero_except([4, 5, 6, 0]) and dkv.aux.read(slot).room == 60
    finally:
        d.close()
        p.close()
        for pool in pools:
            pool.close()
