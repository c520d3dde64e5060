"""Protocol version 2: decode's cached prompt prefix in TransferInfo, and the refusal of a peer
that speaks another version. Real prefill and decode KV managers on loopback (tcp); the "old
peer" is a raw zmq socket sending a well-formed message stamped with version 1."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import zmq
from pd_disagg_util import TestKV, decode, free_port, make_env, prefill, wait_for
from test_managers import PD, ROW, run_room

from pdcore.disagg import wire
from pdcore.disagg.states import KVPoll

TOKENS = list(range(100, 100 + 8))  # 2 pages of 4 tokens: the prefix D holds


@pytest.fixture
def pair():
    port = free_port()
    pkv, dkv = TestKV(seed=1), TestKV()
    p = prefill(pkv, port, make_env(), "tcp")
    d = decode(dkv, make_env(), "tcp")
    yield PD(pkv, p, dkv, d, port)
    d.close()
    p.close()


def _ready(s: PD, room: int, dst: list[int], prefix: int, digest: str) -> int:
    s.p.add(room)
    s.d.add(room, "127.0.0.1", s.port)
    wait_for(lambda: s.d.poll(room) == KVPoll.WaitingForInput, what="decode resolved prefill")
    slot = s.dkv.aux.alloc()
    s.d.send_transfer_info(room, np.array(dst), slot, prefix, digest)
    wait_for(lambda: s.p.poll(room) in (KVPoll.WaitingForInput, KVPoll.Failed),
             what="prefill got pages")
    return slot


def test_prefix_pages_are_not_written_and_not_counted(pair: PD) -> None:
    dst, src = [10, 11, 12, 13], [0, 1, 2, 3]
    _ready(pair, 1, dst, 2, wire.prefix_digest(TOKENS))
    assert pair.p.poll(1) == KVPoll.WaitingForInput, pair.p.failure_reason(1)
    assert pair.p.dest_page_count(1) == 4
    assert pair.p.dest_prefix(1) == (2, wire.prefix_digest(TOKENS))
    p_slot = pair.pkv.aux.alloc()
    pair.pkv.aux.write(p_slot, dataclasses.replace(ROW, room=1))
    pair.p.send(1, np.array(src[2:]), 2, True, p_slot)  # the first chunk starts past the prefix
    wait_for(lambda: pair.d.poll(1) in (KVPoll.Success, KVPoll.Failed), what="decode done")
    assert pair.d.poll(1) == KVPoll.Success, pair.d.failure_reason(1)
    np.testing.assert_array_equal(pair.dkv.dump(dst[2:]), pair.pkv.dump(src[2:]))
    assert pair.dkv.all_zero_except(dst[2:]), "a cached prefix page of decode was written"
    page_bytes = pair.pkv.layout.item_len * 2 * pair.pkv.layout.num_layers
    assert pair.p.metrics()["bytes"] == 2 * page_bytes


def test_chunk_into_the_prefix_fails_the_room(pair: PD) -> None:
    _ready(pair, 2, [10, 11, 12, 13], 2, wire.prefix_digest(TOKENS))
    pair.p.send(2, np.array([1, 2, 3]), 1, True, pair.pkv.aux.alloc())
    wait_for(lambda: pair.d.poll(2) == KVPoll.Failed, what="decode told")
    assert "overlap the 2 cached prefix pages" in pair.p.failure_reason(2)
    assert pair.dkv.all_zero_except([]), "nothing may be written"
    pair.p.release(2)
    pair.d.release(2)
    run_room(pair, 3, [1, 2], [4, 5])  # the pair still serves


@pytest.mark.parametrize("prefix,digest,words", [
    (4, "ab" * 16, "leave at least one"),  # every page cached: nothing left to send
    (2, "", "does not fit prefix_pages"),
    (0, "ab" * 16, "does not fit prefix_pages"),
])
def test_malformed_prefix_is_refused(pair: PD, prefix: int, digest: str, words: str) -> None:
    pair.p.add(5)
    pair.d.add(5, "127.0.0.1", pair.port)
    wait_for(lambda: pair.d.poll(5) == KVPoll.WaitingForInput)
    # straight onto the wire: D's own send_transfer_info() would refuse the first case itself
    pair.d.ctrl.send(pair.p.ctrl.addr, wire.TransferInfo(
        room=5, session=pair.d.session, ctrl_addr=pair.d.ctrl.addr, rank=0, decode_id=pair.d.decode_id,
        dst_pages=np.array([1, 2, 3, 4], "<i4").tobytes(), aux_slot=0, prefix_pages=prefix,
        prefix_digest=digest))
    wait_for(lambda: pair.p.poll(5) == KVPoll.Failed, what="prefill refuses the prefix")
    assert words in pair.p.failure_reason(5)


def test_decode_refuses_a_prefix_covering_every_page(pair: PD) -> None:
    pair.p.add(6)  # D reserves pages only for a room P has
    pair.d.add(6, "127.0.0.1", pair.port)
    wait_for(lambda: pair.d.poll(6) == KVPoll.WaitingForInput)
    pair.d.send_transfer_info(6, np.array([1, 2]), pair.dkv.aux.alloc(), 2, "ab" * 16)
    assert pair.d.poll(6) == KVPoll.Failed
    assert "leaves none of the 2 to transfer" in pair.d.failure_reason(6)


class OldPeer:
    """A peer of protocol version 1: sends well-formed v1 messages, reads what comes back."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self.push: dict[str, zmq.Socket] = {}

    def send(self, to: str, msg: wire.Message) -> None:
        if to not in self.push:
            self.push[to] = self.ctx.socket(zmq.PUSH)
            self.push[to].connect(to)
        self.push[to].send_multipart(wire.encode(msgspec.structs.replace(msg, v=1)))

    def receive(self, timeout_ms: int = 5000) -> dict | None:
        if not self.pull.poll(timeout_ms):
            return None
        return msgspec.msgpack.decode(self.pull.recv())

    def close(self) -> None:
        for s in [self.pull, *self.push.values()]:
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def old_peer():
    peer = OldPeer()
    yield peer
    peer.close()


def _info_v1(room: int, peer: OldPeer) -> wire.TransferInfo:
    return wire.TransferInfo(room=room, session="old-decode", ctrl_addr=peer.addr, rank=0,
                             dst_pages=np.array([1, 2], "<i4").tobytes(), aux_slot=0)


@pytest.mark.parametrize("added_first", [True, False], ids=["room-added", "room-later"])
def test_old_decode_is_refused_in_its_own_version(pair: PD, old_peer: OldPeer,
                                                  added_first: bool) -> None:
    if added_first:
        pair.p.add(7)
    old_peer.send(pair.p.ctrl.addr, _info_v1(7, old_peer))
    reply = old_peer.receive()
    assert reply is not None, "the old decode got no answer (it would wait for its timeout)"
    # the answer is a v1 Status(Failed) the old peer can parse, saying why
    assert reply["t"] == "status" and reply["v"] == 1 and reply["room"] == 7
    assert reply["state"] == int(KVPoll.Failed) and reply["code"] == wire.VERSION_MISMATCH
    assert "version 1" in reply["reason"] and f"speaks {wire.PROTOCOL_VERSION}" in reply["reason"]
    if not added_first:
        pair.p.add(7)  # the request reaches P after the refusal: it fails at once
    assert pair.p.poll(7) == KVPoll.Failed
    why = pair.p.failure_reason(7)
    assert "protocol version 1" in why and f"speaks {wire.PROTOCOL_VERSION}" in why
    assert pair.p.metrics()["version_refusals"] == 1
    assert pair.p.metrics()["version_mismatches"] == 1


def test_old_prefill_status_fails_the_decode_room(pair: PD, old_peer: OldPeer) -> None:
    pair.p.add(8)  # D reserves pages only for a room P has
    pair.d.add(8, "127.0.0.1", pair.port)
    wait_for(lambda: pair.d.poll(8) == KVPoll.WaitingForInput)
    pair.d.send_transfer_info(8, np.array([1, 2]), pair.dkv.aux.alloc())
    old_peer.send(pair.d.ctrl.addr, wire.Status(room=8, state=int(KVPoll.Success), rank=0))
    wait_for(lambda: pair.d.poll(8) == KVPoll.Failed, what="decode refuses the old status")
    assert "protocol version 1" in pair.d.failure_reason(8)
    assert old_peer.receive(300) is None  # a Status is never answered (no ping-pong)


def test_wrong_token_of_an_old_peer_gets_no_answer(old_peer: OldPeer) -> None:
    port = free_port()
    pkv = TestKV()
    p = prefill(pkv, port, make_env(), "tcp", token="right")
    try:
        p.add(9)
        msg = msgspec.structs.replace(_info_v1(9, old_peer), token="wrong")
        old_peer.send(p.ctrl.addr, msg)
        assert old_peer.receive(500) is None
        assert p.poll(9) == KVPoll.Bootstrapping  # a stranger cannot fail a room
    finally:
        p.close()


def _manager(role: str, kv: TestKV, port: int, env, rank: int, tp: int):
    """A KV manager over `kv` that also hands the staging planner its tensors and pool."""
    from pd_disagg_util import make_args

    from pdcore.disagg.decode import DecodeKVManager
    from pdcore.disagg.prefill import PrefillKVManager

    tensors = [(k.tensor, v.tensor) for k, v in zip(kv.k, kv.v)]
    if role == "prefill":
        m = PrefillKVManager(make_args("prefill", port), env, kv.layout, kv.regions, kv.aux,
                             "tcp", tp_rank=rank, tp_size=tp, kv_tensors=tensors, pool=kv.pool,
                             route_secret=f"test-{port}")
    else:
        m = DecodeKVManager(make_args("decode", 1, server_id="test-decode"), env, kv.layout,
                            kv.regions, kv.aux, "tcp",
                            tp_rank=rank, tp_size=tp, kv_tensors=tensors, pool=kv.pool)
    m.start()
    return m


@pytest.mark.parametrize("staged", [False, True], ids=["slices", "staging"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_hetero_tp_prefix_writes_only_the_rest(p_tp: int, d_tp: int, staged: bool) -> None:
    """P and D at different TP sizes, D holding the first of 3 pages: every D rank gets the
    last 2 pages' heads (through the staging grant, sized for those 2 only, or head slices)
    and its cached page is untouched."""
    import importlib.util

    from pdcore.disagg.aux import AuxRow

    if staged and importlib.util.find_spec("pd_staging") is None:
        pytest.skip("pd-staging not installed (pip install -e plugins/pd-staging)")
    src, dst, room, heads = [0, 1, 5], [7, 8, 2], 4343, 2
    port = free_port()
    env = make_env(**({"SGLANG_DISAGG_STAGING_BUFFER": "1"} if staged else {}))
    pkvs = [TestKV(seed=3, tp_rank=r, tp_size=p_tp, total_heads=heads) for r in range(p_tp)]
    dkvs = [TestKV(tp_rank=r, tp_size=d_tp, total_heads=heads) for r in range(d_tp)]
    ps = [_manager("prefill", k, port, env, r, p_tp) for r, k in enumerate(pkvs)]
    ds = [_manager("decode", k, port, env, r, d_tp) for r, k in enumerate(dkvs)]
    digest = wire.prefix_digest(TOKENS[:4])
    try:
        for p in ps:
            p.add(room)
        for d in ds:
            d.add(room, "127.0.0.1", port)
        wait_for(lambda: all(d.poll(room) == KVPoll.WaitingForInput for d in ds))
        slots = [k.aux.alloc() for k in dkvs]
        for d, s in zip(ds, slots):
            d.send_transfer_info(room, np.array(dst), s, 1, digest)
        wait_for(lambda: all(p.poll(room) == KVPoll.WaitingForInput for p in ps),
                 what="every P rank got all its TransferInfos")
        assert all(p.dest_prefix(room) == (1, digest) for p in ps)
        for p, k in zip(ps, pkvs):
            s = k.aux.alloc()
            k.aux.write(s, AuxRow(room=room, first_token_id=5))
            p.send(room, np.array(src[1:]), 1, True, s)
        wait_for(lambda: all(d.poll(room) in (KVPoll.Success, KVPoll.Failed) for d in ds))
        assert [d.poll(room) for d in ds] == [KVPoll.Success] * d_tp, [
            d.failure_reason(room) for d in ds]
        for k in dkvs:
            first, n = k.layout.head_span
            for pk in pkvs:  # the P rank(s) holding these heads
                pf, pn = pk.layout.head_span
                lo, hi = max(first, pf), min(first + n, pf + pn)
                if lo < hi:
                    np.testing.assert_array_equal(
                        k.dump(dst[1:])[..., lo - first:hi - first, :],
                        pk.dump(src[1:])[..., lo - pf:hi - pf, :])
            assert k.all_zero_except(dst[1:]), "decode's cached page was written"
        if staged:
            assert sum(d.metrics().get("staged_rooms", 0) for d in ds) == d_tp
    finally:
        for m in ds + ps[::-1]:
            m.close()


def test_decode_refuses_a_prefill_of_version_1_at_bootstrap(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A prefill announcing version 1 on its bootstrap server: decode fails the room at once,
    naming both versions (it never registers or sends a TransferInfo)."""
    port = free_port()
    pkv, dkv = TestKV(), TestKV()
    with monkeypatch.context() as m:
        m.setattr(wire, "PROTOCOL_VERSION", 1)  # what an old prefill puts in its route
        p = prefill(pkv, port, make_env(), "tcp")
    d = decode(dkv, make_env(), "tcp")
    try:
        d.add(11, "127.0.0.1", port)
        wait_for(lambda: d.poll(11) == KVPoll.Failed, what="decode refuses the old prefill")
        why = d.failure_reason(11)
        assert "protocol version 1" in why and f"decode speaks {wire.PROTOCOL_VERSION}" in why, why
        assert d.metrics().get("registrations", 0) == 0
        assert d.peer_fault(11)  # the router blames the prefill side
    finally:
        d.close()
        p.close()
