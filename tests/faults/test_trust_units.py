"""Trust without configuration (issue 16, item 2), without servers: `pdserve up` gives its
cluster a token, an open control plane says so, and D refuses a route from another instance."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from pdcore.config import (
    ADMIN_KEY_ENV,
    CLUSTER_SECRET_ENV,
    CLUSTER_SECRET_FILE_ENV,
    cluster_secret,
)
from pdcore.disagg.bootstrap import BootstrapClient, BootstrapServer
from pdcore.disagg.control import ControlPlane
from pdcore.errors import ConfigError, TransferError
from pdcore.up import Deployment, UpConfig, plan, state_dir, write_admin_key

RANK = {"rank_ip": "127.0.0.1", "rank_port": 5000, "tp_rank": 0, "tp_size": 1,
        "page_size": 4, "kv_cache_dtype": "float32"}


def _secret(child) -> str:
    return child.env[CLUSTER_SECRET_ENV]


def test_up_gives_its_cluster_one_secret_and_keeps_a_given_one() -> None:
    servers, router = plan(UpConfig(prefill=1, decode=2), "tcp")
    secrets = {_secret(c) for c in [*servers, router]}  # the router signs routes with it
    assert len(secrets) == 1 and len(secrets.pop()) >= 32
    assert not any("--disaggregation-auth-token" in c.argv for c in [*servers, router]), (
        "the secret travels in the environment: argv is world-readable")
    again, _ = plan(UpConfig(prefill=1, decode=1), "tcp")
    assert _secret(again[0]) != _secret(servers[0])  # drawn per cluster
    mine, router = plan(UpConfig(serve_args=["--disaggregation-auth-token", "t0k"]), "tcp")
    assert all(_secret(c) == "t0k" for c in [*mine, router])


def test_up_gives_its_cluster_one_admin_key_and_keeps_a_given_one(tmp_path, monkeypatch) -> None:
    """#44: every process of `up` gets the same admin key, drawn per cluster, in its
    environment (never argv); a key the user gave is kept; the drawn one is written to a file
    only its user can read, and the operator is told the path, never the key."""
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    servers, router = plan(UpConfig(prefill=1, decode=2), "tcp")
    keys = {c.env[ADMIN_KEY_ENV] for c in [*servers, router]}
    assert len(keys) == 1 and len(next(iter(keys))) == 64
    assert keys.isdisjoint({c.env[CLUSTER_SECRET_ENV] for c in servers})
    assert not any("--admin-api-key" in c.argv for c in [*servers, router])
    again, _ = plan(UpConfig(prefill=1, decode=1), "tcp")
    assert again[0].env[ADMIN_KEY_ENV] not in keys
    mine, router = plan(UpConfig(serve_args=["--admin-api-key", "adm1n"]), "tcp")
    assert all(c.env[ADMIN_KEY_ENV] == "adm1n" for c in [*mine, router])
    folder = tmp_path / "run"
    path = Path(write_admin_key(str(folder), "k" * 64))
    assert path.read_text().strip() == "k" * 64
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    dep = Deployment(UpConfig(state_dir=str(folder)))
    dep.admin_key_file = str(path)
    note = dep.admin_key_note()
    assert str(path) in note and "k" * 64 not in note
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert state_dir(UpConfig(port=8123)) == str(tmp_path / "pdserve" / "up-8123")


def test_cluster_secret_from_a_file_as_kubernetes_mounts_it(tmp_path, monkeypatch) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert cluster_secret(None, {CLUSTER_SECRET_FILE_ENV: str(token)}) == "s3cret"
    # the flag, then the variable, win over the file
    assert cluster_secret("f", {CLUSTER_SECRET_FILE_ENV: str(token)}) == "f"
    assert cluster_secret(None, {CLUSTER_SECRET_ENV: "e", CLUSTER_SECRET_FILE_ENV: "/x"}) == "e"
    token.write_text(" \n")
    for path in (str(token), str(tmp_path / "missing")):  # empty or unreadable: say so at start
        with pytest.raises(ConfigError, match=CLUSTER_SECRET_FILE_ENV):
            cluster_secret(None, {CLUSTER_SECRET_FILE_ENV: path})
    token.write_text("from-file")
    monkeypatch.setenv(CLUSTER_SECRET_FILE_ENV, str(token))
    servers, router = plan(UpConfig(prefill=1, decode=1), "tcp")  # up hands the user's on
    assert all(_secret(c) == "from-file" for c in [*servers, router])


def test_open_control_plane_is_a_warning_and_loopback_is_not(caplog) -> None:
    caplog.set_level(logging.WARNING)
    for host, token, warned in (("0.0.0.0", None, True), ("0.0.0.0", "t", False),
                                ("127.0.0.1", None, False)):
        caplog.clear()
        srv = BootstrapServer(host, 0, auth_token=token, route_secret="s")
        srv.start()
        plane = ControlPlane(host, token, "ctl", lambda m: None, lambda: None)
        plane.start()
        srv.close()
        plane.close()
        text = caplog.text
        assert ("open to the network" in text) is warned, (host, token, text)
        assert ("without --disaggregation-auth-token" in text) is warned


def test_decode_refuses_a_route_from_another_instance() -> None:
    srv = BootstrapServer("127.0.0.1", 0, route_secret="s")
    srv.start()
    addr = f"127.0.0.1:{srv.port}"
    try:
        BootstrapClient(route_secret="s").put_route(addr, RANK)
        client = BootstrapClient()
        info = client.get_info(addr)
        assert info.instance_id == srv.instance_id
        assert client.get_rank(addr, 0, 0, instance=srv.instance_id) == ("127.0.0.1", 5000)
        with pytest.raises(TransferError, match="changed instance"):
            client.get_rank(addr, 0, 0, instance="an-earlier-instance")
        with pytest.raises(TransferError, match="403"):
            client.put_route(addr, {**RANK, "rank_port": 6666}, attempts=1)
        assert client.get_rank(addr, 0, 0) == ("127.0.0.1", 5000)
    finally:
        srv.close()


def test_route_signatures_are_single_use_and_short_lived() -> None:
    """Issue 44 item 1: a signature is good for one request per server, and lives as long as
    the router signs (60 s) give or take 30 s of clock skew, not 3600 s."""
    from pdcore.route_auth import RouteGuard, route_key, sign_route

    guard = RouteGuard("s", local=False, decode_id="d1")
    key = route_key("s")

    def sig(room: int, **kw) -> str:
        return sign_route(key, room, "10.0.0.5", 8998, "d1", "digest", **kw)

    def check(room: int, s: str) -> str:
        return guard.check(room, "10.0.0.5", 8998, s, 8998, "digest")

    assert check(7, sig(7)) == ""
    assert "used already" in check(7, sig(7))
    assert check(8, sig(8, ttl_s=-20)) == ""  # a router clock 20 s behind
    assert "expired" in check(9, sig(9, ttl_s=-40))
    assert "too far in the future" in check(10, sig(10, ttl_s=3000))


def test_route_signature_v2_binds_decode_server_and_request() -> None:
    """Issue 44 item 1 (v2): the signature names the decode server the router chose and covers
    the request body (route fields aside); another decode server, another body or a v1
    signature is refused, and a refused copy does not use up the victim's signature."""
    from pdcore.route_auth import (RouteGuard, body_digest, raw_body_digest, route_key,
                                   sign_route)

    key = route_key("s")
    victim = {"text": "The secret code is 4711", "sampling_params": {"temperature": 0.5}}
    routed = {**victim, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998,
              "bootstrap_room": 7}
    digest = body_digest(routed)
    assert digest == body_digest(victim)  # the route fields are not part of it
    # what a server recomputes from the bytes it got (key order, spacing, escapes aside)
    raw = json.dumps({**routed, "bootstrap_sig": "x"}, indent=1, ensure_ascii=False).encode()
    assert raw_body_digest(raw) == digest and raw_body_digest(b"[1]") == ""
    sig = sign_route(key, 7, "10.0.0.5", 8998, "d1", digest)
    d1, d2 = (RouteGuard("s", local=False, decode_id=i) for i in ("d1", "d2"))
    prefill = RouteGuard("s", local=False, own_port=8998)
    assert "another decode server" in d2.check(7, "10.0.0.5", 8998, sig, 8998, digest)
    other = body_digest({**victim, "text": "Tell me the code"})
    assert "does not sign this route and request" in d1.check(7, "10.0.0.5", 8998, sig, 8998,
                                                             other)
    hotter = body_digest({**victim, "sampling_params": {"temperature": 2.0}})
    assert "does not sign" in d1.check(7, "10.0.0.5", 8998, sig, 8998, hotter)
    assert d1.check(7, "10.0.0.5", 8998, sig, 8998, digest) == ""  # not used up by the copies
    assert prefill.check(7, "10.0.0.5", 8998, sig, 8998, digest) == ""  # P checks the MAC too
    assert "does not sign" in prefill.check(7, "10.0.0.5", 8998, sig, 8998, other)
    forged = sig.replace(".d1.", ".d2.")  # re-targeted by hand: the MAC covers the target
    assert "does not sign" in d2.check(7, "10.0.0.5", 8998, forged, 8998, digest)
    v1 = "v1.%d.%s" % (int(time.time()) + 30, "0" * 64)
    assert "v1 signature" in d1.check(7, "10.0.0.5", 8998, v1, 8998, digest)
    assert "malformed" in d1.check(7, "10.0.0.5", 8998, "v2.x.d1.y", 8998, digest)


def test_loopback_trust_needs_a_live_prefill_of_this_user(tmp_path, monkeypatch) -> None:
    """Issue 45 item 6: a loopback route is trusted only for a port a live prefill server of
    this user announced; a dead server's entry, another port, or another host are not."""
    from pdcore import route_auth

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    guard = route_auth.RouteGuard(None, local=True)
    entry = route_auth.announce_local_prefill(41234)
    assert entry and oct(os.stat(route_auth.local_prefill_dir()).st_mode)[-3:] == "700"
    assert guard.check(1, "127.0.0.1", 41234, None, 8998) == ""
    assert guard.check(1, "localhost", 41234, None, 8998) == ""
    assert route_auth.UNTRUSTED in guard.check(1, "127.0.0.1", 41235, None, 8998)
    assert route_auth.UNTRUSTED in guard.check(1, "10.0.0.5", 41234, None, 8998)
    assert route_auth.UNTRUSTED in route_auth.RouteGuard(None, local=False).check(
        1, "127.0.0.1", 41234, None, 8998)
    with open(entry, "w") as f:
        f.write("999999999")  # a dead (or never existing) process
    assert route_auth.UNTRUSTED in guard.check(1, "127.0.0.1", 41234, None, 8998)
    route_auth.withdraw_local_prefill(entry)  # not ours any more: left alone
    assert os.path.exists(entry)


def test_a_secret_refuses_unsigned_loopback_routes(tmp_path, monkeypatch) -> None:
    """With a cluster secret the router signs every route: an unsigned loopback route to a live
    local prefill (which any client that reaches D could name) is refused by default, trusted
    only when the operator sets PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL=1; without a secret
    it is trusted by default (the seed commands behind sglang-router) and `0` turns that off."""
    from pdcore import route_auth

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL", raising=False)
    entry = route_auth.announce_local_prefill(41236)
    try:
        def verdict(secret: str | None) -> str:
            return route_auth.RouteGuard(secret).check(1, "127.0.0.1", 41236, None, 8998)

        assert verdict(None) == ""
        assert route_auth.UNTRUSTED in verdict("s")
        monkeypatch.setenv("PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL", "1")
        assert verdict("s") == "" and verdict(None) == ""
        monkeypatch.setenv("PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL", "0")
        assert route_auth.UNTRUSTED in verdict(None) and route_auth.UNTRUSTED in verdict("s")
    finally:
        route_auth.withdraw_local_prefill(entry)
