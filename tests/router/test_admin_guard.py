"""Admin routes are closed by default (issue #30, part 2): on the router and on the servers,
a route that changes state needs --api-key's token or, without a key, a loopback peer.

A non-loopback peer is a Starlette TestClient whose client address is set: no traffic leaves
this machine. The loopback side runs on real sockets (127.0.0.1) in test_add_and_remove_...
of test_router_policies_admin.py; here the guard is also checked for IPv6 and mapped peers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pdcore.config import ServerArgs
from pdcore.router.app import create_app
from pdcore.router.config import RouterConfig
from pdcore.server.auth import admin_routes, is_loopback_peer

ROGUE = ("10.1.2.3", 5000)
P, D = "http://127.0.0.1:9", "http://127.0.0.1:7"  # nothing listens there
ROUTER_ADMIN = [
    ("POST", "/workers", {"json": {"url": "http://10.9.9.9:30001", "worker_type": "decode"}}),
    ("DELETE", "/workers", {"params": {"url": D}}),
    ("DELETE", f"/workers/{D}", {}),
    ("POST", "/add_worker", {"params": {"url": "http://10.9.9.9:30001",
                                        "worker_type": "decode"}}),
    ("POST", "/remove_worker", {"params": {"url": D}}),
    ("POST", "/flush_cache", {}),
]


def _router_app(**kwargs: object):  # type: ignore[no-untyped-def]
    return create_app(RouterConfig(prefill=[(P, None)], decode=[D], **kwargs))  # type: ignore[arg-type]


def _urls(client: TestClient) -> set[str]:
    return {w["url"] for w in client.get("/workers").json()["workers"]}


def test_router_admin_routes_refuse_a_remote_peer_without_a_key() -> None:
    client = TestClient(_router_app(), client=ROGUE)
    for method, path, kw in ROUTER_ADMIN:
        # a forged header naming loopback changes nothing: only the socket's address counts
        r = client.request(method, path, headers={"x-forwarded-for": "127.0.0.1"}, **kw)
        assert r.status_code == 403, (method, path, r.text)
        message = r.json()["error"]["message"]
        assert "--api-key" in message and "loopback" in message and ROGUE[0] in message
    assert _urls(client) == {P, D}  # nothing was added or removed
    # the read-only routes stay open
    for path in ("/workers", "/metrics", "/liveness", "/dashboard"):
        assert client.get(path).status_code == 200, path


def test_router_admin_routes_with_api_key() -> None:
    with TestClient(_router_app(api_key="sekrit"), client=ROGUE) as client:
        body = {"url": "http://127.0.0.1:5", "worker_type": "decode"}
        assert client.post("/workers", json=body).status_code == 401
        bad = client.post("/workers", json=body, headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = client.post("/workers", json=body, headers={"authorization": "Bearer sekrit"})
        assert ok.status_code in (200, 202), ok.text  # 202: nothing answers its /health
        auth = {"authorization": "Bearer sekrit"}
        assert "http://127.0.0.1:5" in _urls_with(client, auth)
        r = client.post("/remove_worker", params={"url": "http://127.0.0.1:5"}, headers=auth)
        assert r.status_code == 200, r.text
        assert "http://127.0.0.1:5" not in _urls_with(client, auth)


def _urls_with(client: TestClient, headers: dict[str, str]) -> set[str]:
    return {w["url"] for w in client.get("/workers", headers=headers).json()["workers"]}


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
def test_router_admin_routes_answer_loopback_peers(peer: str) -> None:
    client = TestClient(_router_app(), client=(peer, 5000))
    assert client.post("/remove_worker", params={"url": D}).status_code == 200
    assert _urls(client) == {P}


@pytest.mark.parametrize("host", ["10.1.2.3", "192.168.0.1", "::ffff:10.0.0.1", "fd00::2",
                                  "localhost", "testclient", "", None, "127.0.0.1.evil"])
def test_only_loopback_addresses_are_loopback_peers(host: str | None) -> None:
    assert not is_loopback_peer(host)


def test_router_logs_its_admin_routes_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdcore.router"):
        app = _router_app()
    line = next(r.getMessage() for r in caplog.records if "admin routes" in r.getMessage())
    assert "POST /workers" in line and "POST /flush_cache" in line and "loopback" in line
    assert set(admin_routes(app)) == {f"{m} {p}" for m, p in [
        ("POST", "/workers"), ("DELETE", "/workers"), ("DELETE", "/workers/{url:path}"),
        ("POST", "/add_worker"), ("POST", "/remove_worker"), ("POST", "/flush_cache")]}


def test_server_admin_routes_refuse_a_remote_peer(tiny_llama_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from pdcore.server.app import create_app as create_server_app

    with caplog.at_level(logging.INFO, logger="pdcore.server.app"):
        app = create_server_app(ServerArgs(model_path=str(tiny_llama_dir)))
    assert set(admin_routes(app)) == {"POST /flush_cache", "GET /flush_cache",
                                      "POST /start_profile", "POST /stop_profile"}
    assert any("admin routes" in r.getMessage() and "loopback" in r.getMessage()
               for r in caplog.records)
    rogue = TestClient(app, client=ROGUE)  # no lifespan: the engine is never started
    for method, path in (("POST", "/flush_cache"), ("GET", "/flush_cache"),
                         ("POST", "/start_profile"), ("POST", "/stop_profile")):
        r = rogue.request(method, path)
        assert r.status_code == 403, (method, path, r.text)
        assert "--api-key" in r.json()["error"]["message"]
    # a loopback peer passes the guard and reaches the route (the engine is not running: 503)
    local = TestClient(app, client=("127.0.0.1", 5000))
    assert local.post("/flush_cache").status_code == 503


def test_server_admin_routes_with_api_key(tiny_llama_dir: Path) -> None:
    from pdcore.server.app import create_app as create_server_app

    app = create_server_app(ServerArgs(model_path=str(tiny_llama_dir), api_key="sekrit"))
    rogue = TestClient(app, client=ROGUE)
    assert rogue.post("/flush_cache").status_code == 401
    assert rogue.post("/flush_cache", headers={"authorization": "Bearer x"}).status_code == 401
    ok = rogue.post("/flush_cache", headers={"authorization": "Bearer sekrit"})
    assert ok.status_code == 503  # past the key check; the engine was never started
