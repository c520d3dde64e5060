"""Units: poll-state rules, aux rows, wire messages, bootstrap server and client."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.request

import msgspec
import numpy as np
import pytest
from pd_disagg_util import HostPool, TestKV, free_port

from pdcore.disagg import wire
from pdcore.disagg.aux import EMPTY_ROOM, MAX_TOP_LOGPROBS, AuxBuffers, AuxRow
from pdcore.disagg.bootstrap import INSTANCE_HEADER, BootstrapClient, BootstrapServer
from pdcore.disagg.states import KVPoll, RoomStates
from pdcore.errors import ProtocolError, TransferError
from pdcore.messages.bootstrap import BootstrapInfo


# -- states ------------------------------------------------------------------------------------
def test_states_only_move_up_and_failed_wins() -> None:
    s = RoomStates()
    assert not s.advance(1, KVPoll.Transferring)  # unknown room: nothing created
    assert s.get(1) is None
    s.create(1)
    assert s.advance(1, KVPoll.Transferring)
    assert not s.advance(1, KVPoll.WaitingForInput) and s.get(1) is KVPoll.Transferring
    assert s.fail(1, "boom") and not s.fail(1, "second")
    assert not s.advance(1, KVPoll.Success)
    assert s.get(1) is KVPoll.Failed and s.reason(1) == "boom"
    s.remove(1)
    assert not s.fail(1, "late") and s.get(1) is None
    assert int(KVPoll.Failed) == 0 and int(KVPoll.Success) == 4


# -- aux ---------------------------------------------------------------------------------------
def test_aux_rows_round_trip_and_allocator() -> None:
    aux = AuxBuffers(HostPool(), 3)
    assert aux.row_bytes % 64 == 0 and aux.region.length == 3 * aux.row_bytes
    slots = [aux.alloc() for _ in range(3)]
    assert slots == [0, 1, 2] and aux.alloc() is None and aux.num_free == 0
    ids = tuple(range(MAX_TOP_LOGPROBS))
    lps = tuple(float(-i) for i in range(MAX_TOP_LOGPROBS))
    row = AuxRow(room=(1 << 63) - 1, first_token_id=123, logprob=-1.5, top_ids=ids,
                 top_logprobs=lps, cached_tokens=4, prompt_tokens=99)
    aux.write(1, row)
    assert aux.read(1) == row
    assert aux.read(0).room == EMPTY_ROOM  # never written
    copy = AuxBuffers(HostPool(), 3)
    copy.write_raw(2, aux.raw(1))
    assert copy.read(2) == row
    aux.free(1)  # freeing clears the row: a stale row never passes the room check
    assert aux.read(1).room == EMPTY_ROOM
    assert [aux.alloc() for _ in range(1)] == [1]  # FIFO
    with pytest.raises(ValueError, match="double free|not allocated"):
        aux.free(1) or aux.free(1)
    with pytest.raises(ValueError, match="at most"):
        aux.write(0, AuxRow(room=1, first_token_id=0, top_ids=ids + (1,), top_logprobs=lps + (0.0,)))
    with pytest.raises(IndexError):
        aux.read(3)


# -- wire --------------------------------------------------------------------------------------
def _info(**kw) -> wire.TransferInfo:
    base = {"room": 5, "session": "s", "ctrl_addr": "tcp://127.0.0.1:1", "rank": 0,
            "dst_pages": wire.encode_pages(np.array([3, 1, 2])), "aux_slot": 4}
    return wire.TransferInfo(**{**base, **kw})


def test_wire_round_trip_and_mac() -> None:
    frames = wire.encode(_info(), "tok")
    assert len(frames) == 2  # payload, MAC
    secret = "s3cret-value-0123"
    assert secret.encode() not in b"".join(wire.encode(_info(), secret)), "it never travels"
    msg = wire.decode(frames, "tok")
    assert isinstance(msg, wire.TransferInfo) and msg.pages().tolist() == [3, 1, 2]
    assert msg.v == wire.PROTOCOL_VERSION and msg.aux_slot == 4
    with pytest.raises(ProtocolError, match="wrong MAC"):
        wire.decode(frames, "other")
    with pytest.raises(ProtocolError, match="wrong MAC"):  # a payload changed in flight
        wire.decode([frames[0].replace(b"\x05", b"\x06", 1), frames[1]], "tok")
    with pytest.raises(ProtocolError, match="no MAC"):
        wire.decode(wire.encode(_info()), "tok")
    with pytest.raises(ProtocolError, match="no --disaggregation-auth-token"):
        wire.decode(frames)
    st = wire.decode(wire.encode(wire.Status(room=1, state=4, rank=0, aux=b"\x00\x01")))
    assert isinstance(st, wire.Status) and st.aux == b"\x00\x01"


def test_wire_answers_an_old_peer_only_when_it_proves_the_secret() -> None:
    old = msgspec.msgpack.encode({"t": "transfer_info", "v": 2, "token": "tok", "room": 7,
                                  "session": "s", "ctrl_addr": "tcp://127.0.0.1:1"})
    with pytest.raises(wire.VersionMismatch) as e:
        wire.decode([old], "tok")
    frames = wire.refusal(e.value, rank=0, token="tok")
    assert frames is not None and len(frames) == 1  # in the old peer's own format
    assert msgspec.msgpack.decode(frames[0])["v"] == 2
    forged = old.replace(b"tok", b"bad")
    with pytest.raises(ProtocolError) as e2:
        wire.decode([forged], "tok")
    assert not isinstance(e2.value, wire.VersionMismatch)


def test_wire_rejects_version_and_garbage() -> None:
    newer = msgspec.msgpack.encode({"t": "status", "v": 99, "room": 1, "state": 4, "rank": 0})
    with pytest.raises(ProtocolError, match="protocol version 99"):
        wire.decode([newer])
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode([b"\xff\x00garbage"])
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode([msgspec.msgpack.encode({"t": "status", "v": wire.PROTOCOL_VERSION,
                                            "room": "x"})])
    with pytest.raises(ProtocolError, match="frames"):
        wire.decode([b"a", b"b", b"c"])
    with pytest.raises(ProtocolError, match="whole number"):
        _info(dst_pages=b"\x00\x01\x02").pages()


def test_compatibility_checks() -> None:
    layout = TestKV().layout
    wire.check_compatible("prefill", layout.page_size, "float32", layout)
    with pytest.raises(ProtocolError, match="page size 16"):
        wire.check_compatible("prefill", 16, "float32", layout)
    with pytest.raises(ProtocolError, match="dtype bfloat16"):
        wire.check_compatible("prefill", layout.page_size, "bfloat16", layout)
    same = BootstrapInfo(tp_size=1, page_size=layout.page_size, kv_cache_dtype="float32",
                         model_fingerprint="aa", num_layers=layout.num_layers)
    wire.check_pairing("prefill", same, layout, "aa")
    wire.check_pairing("prefill", same, layout, "")  # a peer that names no model: not compared
    with pytest.raises(ProtocolError, match="another model"):
        wire.check_pairing("prefill", same, layout, "bb")
    more = dataclasses.replace(same, num_layers=layout.num_layers + 1)
    with pytest.raises(ProtocolError, match="num_layers"):
        wire.check_pairing("prefill", more, layout, "aa")
    # a draft head's layer on one side only (EAGLE on decode, not on prefill, or the reverse)
    drafted = dataclasses.replace(layout, num_layers=layout.num_layers + 1, draft_layers=1)
    with pytest.raises(ProtocolError, match="runs no draft head.*--speculative-algorithm"):
        wire.check_pairing("prefill", same, drafted, "aa")
    with pytest.raises(ProtocolError, match="prefill runs a speculative draft head"):
        wire.check_pairing("prefill", dataclasses.replace(more, draft_layers=1), layout, "aa")
    wire.check_pairing("prefill", dataclasses.replace(more, draft_layers=1), drafted, "aa")


# -- bootstrap ---------------------------------------------------------------------------------
def _rank(tp_rank: int, tp_size: int = 2, **kw) -> dict:
    return {"rank_ip": "127.0.0.1", "rank_port": 5000 + tp_rank, "tp_rank": tp_rank,
            "tp_size": tp_size, "page_size": 4, "kv_cache_dtype": "float32", **kw}


def _get(port: int, path: str) -> tuple[int, dict | str, str]:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            body = r.read().decode()
            return r.status, (json.loads(body) if body.startswith("{") else body), r.headers.get(
                INSTANCE_HEADER, "")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode()), ""


SECRET = "rank-secret"


def test_bootstrap_server_routes() -> None:
    srv = BootstrapServer("127.0.0.1", 0, route_secret=SECRET)
    srv.start()
    try:
        port, addr = srv.port, f"127.0.0.1:{srv.port}"
        client = BootstrapClient(route_secret=SECRET)
        status, body, inst = _get(port, "/health")
        assert (status, body, inst) == (200, "OK", srv.instance_id)
        assert client.health(addr) == srv.instance_id
        assert _get(port, "/route?target_tp_rank=0")[0] == 400
        assert _get(port, "/route?prefill_dp_rank=-1&target_tp_rank=-1")[0] == 503
        client.put_route(addr, _rank(0))
        assert _get(port, "/route?prefill_dp_rank=0&target_tp_rank=0")[0] == 503  # rank 1 missing
        with pytest.raises(TransferError, match="disagrees"):
            client.put_route(addr, _rank(1, page_size=8), attempts=1)
        client.put_route(addr, _rank(1))
        info = client.get_info(addr)
        assert info.tp_size == 2 and info.page_size == 4 and info.instance_id == inst
        # #46: the instance's facts are typed (messages/bootstrap.py), read field by field: a
        # field of the wrong type is refused naming it, before it is kept or compared
        with pytest.raises(TransferError, match="400.*page_size must be an integer"):
            client.put_route(addr, {**_rank(0), "page_size": "4"}, attempts=1)
        with pytest.raises(TransferError, match="400.*is_mla must be a bool"):
            client.put_route(addr, {**_rank(0), "is_mla": "yes"}, attempts=1)
        assert client.get_rank(addr, 0, 1) == ("127.0.0.1", 5001)
        assert _get(port, "/route?prefill_dp_rank=0&target_tp_rank=5")[0] == 404
        with pytest.raises(TransferError, match="missing"):
            client.put_route(addr, {"rank_ip": "x"}, attempts=1)
    finally:
        srv.close()


def test_bootstrap_put_requires_token_when_configured() -> None:
    srv = BootstrapServer("127.0.0.1", 0, auth_token="s3", route_secret=SECRET)
    srv.start()
    try:
        addr = f"127.0.0.1:{srv.port}"
        with pytest.raises(TransferError, match="401"):
            BootstrapClient(token="nope", route_secret=SECRET).put_route(addr, _rank(0, 1), attempts=1)
        BootstrapClient(token="s3", route_secret=SECRET).put_route(addr, _rank(0, 1))
        assert BootstrapClient().get_rank(addr, 0, 0) == ("127.0.0.1", 5000)
    finally:
        srv.close()


def test_bootstrap_client_retries_until_ready_and_bounds_retries() -> None:
    srv = BootstrapServer("127.0.0.1", 0, route_secret=SECRET)
    srv.start()
    addr = f"127.0.0.1:{srv.port}"
    try:
        threading.Timer(0.3, lambda: BootstrapClient(route_secret=SECRET).put_route(addr, _rank(0, 1))).start()
        t0 = time.monotonic()
        assert BootstrapClient().get_info(addr, attempts=20, interval=0.1).tp_size == 1
        assert time.monotonic() - t0 < 3
    finally:
        srv.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="failed"):
        BootstrapClient(connect_timeout=0.2).get_info(f"127.0.0.1:{free_port()}", attempts=3,
                                                      interval=0.1)
    assert time.monotonic() - t0 < 2


def test_bootstrap_port_in_use_is_a_clear_error() -> None:
    srv = BootstrapServer("127.0.0.1", 0, route_secret=SECRET)
    srv.start()
    try:
        with pytest.raises(TransferError, match="--disaggregation-bootstrap-port"):
            BootstrapServer("127.0.0.1", srv.port, route_secret=SECRET).start()
    finally:
        srv.close()


def _register(kv: TestKV, **kw) -> wire.Register:
    base = {"session": "d1", "ctrl_addr": "tcp://127.0.0.1:1", "backend": "tcp",
            "endpoint": b"{}", "layout": kv.layout.to_dict(),
            "regions": [r.to_dict() for r in kv.regions], "aux_region": kv.aux.region.to_dict(),
            "aux_row_bytes": kv.aux.row_bytes, "aux_slots": kv.aux.num_slots, "rank": 0,
            "tp_size": 1, "page_size": kv.layout.page_size, "dtype": "float32"}
    return wire.Register(**{**base, **kw})


def test_parse_register_rejects_hostile_layouts() -> None:
    from pdcore.builtin.planner import DefaultPlanner
    from pdcore.disagg.sessions import parse_register

    local, remote = TestKV(seed=1), TestKV()
    ok = parse_register(_register(remote), local.layout, "tcp", local.aux.row_bytes,
                        DefaultPlanner())
    assert ok.check_pages(np.array([0, 31])) == "" and "page index 32" in ok.check_pages(
        np.array([3, 32]))
    assert ok.check_aux_slot(-1) == "" and "aux slot 8" in ok.check_aux_slot(8)
    bigger = {**remote.layout.to_dict(), "num_pages": 10_000}  # claims more than it registered
    cases = [
        ({"layout": bigger}, "outside its registered"),
        ({"backend": "shm"}, "transfer backend"),
        ({"aux_slots": 10_000}, "aux region smaller"),
        ({"aux_row_bytes": 64}, "aux rows are 64 bytes"),
        ({"layout": {"num_layers": 1}}, "malformed"),
        ({"page_size": 8}, "page size 8"),
    ]
    for change, words in cases:
        with pytest.raises(ProtocolError, match=words):
            parse_register(_register(remote, **change), local.layout, "tcp", local.aux.row_bytes,
                           DefaultPlanner())


# -- planner choice ----------------------------------------------------------------------------
def test_make_planner_takes_the_configured_planner_from_the_registry() -> None:
    from pdcore.config import DisaggEnv
    from pdcore.disagg.common import make_planner
    from pdcore.errors import UnknownNameError
    from pdcore.plugins.host import PluginHost, reset_host, transfer_planners

    assert make_planner(DisaggEnv.from_env({})).name == "default"
    if "staging" in transfer_planners():
        staging = make_planner(DisaggEnv.from_env({"SGLANG_DISAGG_STAGING_BUFFER": "1"}))
        assert staging.name == "staging"
    # no builtin plugin, no default planner: a clear error, never a hidden import of builtin/
    reset_host(PluginHost(env={"PDCORE_DISABLE_PLUGINS": "builtin"}, entry_points=[]))
    try:
        with pytest.raises(UnknownNameError, match="default"):
            make_planner(DisaggEnv.from_env({}))
    finally:
        reset_host()
