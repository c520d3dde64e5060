"""Admin is its own credential (issue #44, items 2 and 3), on the router and on the servers.

Found: with `--api-key`, an ordinary API user added a decode worker with `POST /workers` and
received other users' requests; without `--api-key`, every admin route answered any loopback
peer, so every client behind nginx, a sidecar, port-forward or a same-host TCP proxy was an
admin. Now: admin routes answer only `--admin-api-key` (the API key gets 403, no key 401, and
without an admin key they are off: 403 for everyone, loopback included).

The route inventory is read from the apps themselves: a new route that changes state without
the guard fails `test_every_state_changing_route_is_an_admin_route`. The attacks run on real
loopback sockets (uvicorn in a thread; fake workers stand in for the servers behind the router;
the servers' own app with an engine stand-in, since the guard acts before any engine call).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_workers import ServerThread
from fastapi.testclient import TestClient

from pdcore.config import (
    ADMIN_KEY_ENV,
    ADMIN_KEY_FILE_ENV,
    ServerArgs,
    admin_api_key,
)
from pdcore.edge.auth import admin_routes
from pdcore.errors import ConfigError
from pdcore.messages.info import EngineInfo
from pdcore.router.app import GENERATION_ROUTES, create_app
from pdcore.router.cli import parse_router_args
from pdcore.router.config import RouterConfig
from pdcore.runtime import EngineState
from pdcore.server.admin_routes import server_info
from pdcore.server.app import GENERATE_ROUTES

API, ADMIN = "api-key-of-every-user", "the-operators-admin-key"
AS_USER = {"authorization": f"Bearer {API}"}
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
ROGUE = "http://127.0.0.1:9"  # the worker an attacker would add (nothing listens there)
ROUTER_ADMIN = {"POST /workers", "DELETE /workers", "DELETE /workers/{url:path}",
                "POST /add_worker", "POST /remove_worker", "POST /flush_cache",
                "GET /fleet/ledger"}  # read, but it names the workers a peer router takes
SERVER_ADMIN = {"POST /flush_cache", "GET /flush_cache", "POST /start_profile", "POST /drain",
                "POST /stop_profile", "POST /disaggregation/trusted_prefill"}


class _Engine:
    """Enough of an EngineClient for the HTTP layer: ready, never asked for anything here."""

    def __init__(self, args: ServerArgs) -> None:
        self.args, self.ready, self.state, self.error, self.info = (
            args, True, EngineState.READY, None, EngineInfo())

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def control(self, kind: str, *a: Any, **kw: Any) -> dict[str, Any]:
        return {"flushed": True, "kind": kind}


def server_app(tiny: Path, **kw: Any):  # type: ignore[no-untyped-def]
    from pdcore.server.app import create_app as create_server_app

    args = ServerArgs(model_path=str(tiny), disaggregation_mode="decode", **kw)
    return create_server_app(args, engine=_Engine(args))  # type: ignore[arg-type]


def router_config(prefill: str, decode: str, **kw: Any) -> RouterConfig:
    return RouterConfig(prefill=[(prefill, None)], decode=[decode], mini_lb=True, **kw)


def calls(app: Any) -> list[tuple[str, str]]:
    """(method, concrete path) of every admin route of `app`."""
    out = []
    for entry in admin_routes(app):
        method, path = entry.split(" ", 1)
        out.append((method, path.replace("{url:path}", ROGUE)))
    return out


def body_of(path: str) -> dict[str, Any]:
    if path == "/workers":
        return {"json": {"url": ROGUE, "worker_type": "decode"}}
    if path == "/add_worker":
        return {"params": {"url": ROGUE, "worker_type": "decode"}}
    if path == "/disaggregation/trusted_prefill":
        return {"json": {"add": ["127.0.0.1:9"]}}
    return {}


class Proxy:
    """A same-host TCP proxy (what nginx, a sidecar or `kubectl port-forward` are to the
    server): its connections to the target come from 127.0.0.1."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path) -> Iterator[dict[str, Any]]:
    """On loopback: a decode server without keys, one with both keys; a router without keys in
    front of the first, one with both keys in front of the second (prefill: a port where
    nothing listens; mini-lb: no health checks)."""
    open_d = ServerThread(server_app(tiny_llama_dir)).start()
    keyed_d = ServerThread(server_app(tiny_llama_dir, api_key=API,
                                      admin_api_key=ADMIN)).start()
    open_r = ServerThread(create_app(router_config("http://127.0.0.1:8", open_d.url))).start()
    keyed_r = ServerThread(create_app(router_config("http://127.0.0.1:8", keyed_d.url,
                                                    api_key=API, admin_api_key=ADMIN))).start()
    out = {"open_d": open_d, "keyed_d": keyed_d, "open_r": open_r, "keyed_r": keyed_r}
    deadline = time.monotonic() + 30  # the keyed router registers its prefill (admin key)
    while "127.0.0.1:8998" not in trusted(keyed_d.url, AS_USER):
        assert time.monotonic() < deadline, "the keyed router never registered its prefill"
        time.sleep(0.05)
    yield out
    for s in out.values():
        s.stop()


def workers(router_url: str, headers: dict[str, str] | None = None) -> set[str]:
    return {w["url"] for w in httpx.get(router_url + "/workers", headers=headers,
                                        timeout=10).json()["workers"]}


def trusted(server_url: str, headers: dict[str, str] | None = None) -> list[str]:
    return httpx.get(server_url + "/disaggregation/trusted_prefill", headers=headers,
                     timeout=10).json()["trusted"]


def test_every_state_changing_route_is_an_admin_route(tiny_llama_dir: Path) -> None:
    """The inventory: every route that is not a read (GET) nor inference is an admin route, on
    the router and on a PD server (GET /flush_cache too: SGLang's clients flush with GET)."""
    router = create_app(router_config("http://127.0.0.1:8", "http://127.0.0.1:7"))
    server = server_app(tiny_llama_dir)
    inference = {*GENERATE_ROUTES, *GENERATION_ROUTES}  # each app's own list
    for app, expected in ((router, ROUTER_ADMIN), (server, SERVER_ADMIN)):
        assert set(admin_routes(app)) == expected
        writes = {f"{m} {p}" for m, p in _all_routes(app) if m not in ("GET", "HEAD")
                  and p not in inference}
        assert writes <= expected, f"state-changing routes without the admin guard: " \
                                   f"{sorted(writes - expected)}"


def _all_routes(app: Any) -> list[tuple[str, str]]:
    from fastapi.routing import APIRoute

    out: list[tuple[str, str]] = []

    def walk(routes: Any) -> None:
        for r in routes:
            if isinstance(r, APIRoute):
                out.extend((m, r.path) for m in r.methods or ())
            elif getattr(r, "original_router", None) is not None:
                walk(r.original_router.routes)

    walk(app.routes)
    assert len(out) > 15, out  # the walk found the routes
    return out


@pytest.mark.parametrize("target", ["keyed_r", "keyed_d"])
def test_the_api_key_never_opens_an_admin_route(servers, target: str) -> None:
    """Finding 2: an API user's key (and no key, and a wrong key) gets 401/403 on every admin
    route and nothing changes; the admin key opens each."""
    url = servers[target].url
    app = servers[target].server.config.app
    before_w = workers(servers["keyed_r"].url, AS_USER)
    before_t = trusted(servers["keyed_d"].url, AS_USER)
    for method, path in calls(app):
        for headers, status in ((AS_USER, 403), ({}, 401),
                                ({"authorization": "Bearer guess"}, 401)):
            r = httpx.request(method, url + path, headers=headers, timeout=10, **body_of(path))
            assert r.status_code == status, (method, path, headers, r.text)
        r = httpx.request(method, url + path, headers=AS_USER, timeout=10, **body_of(path))
        assert "--admin-api-key" in r.json()["error"]["message"]
    assert workers(servers["keyed_r"].url, AS_USER) == before_w  # no worker was added
    assert trusted(servers["keyed_d"].url, AS_USER) == before_t  # no address is trusted
    # the admin key opens them (and the ordinary routes)
    if target == "keyed_r":
        r = httpx.post(url + "/workers", json=body_of("/workers")["json"], headers=AS_ADMIN,
                       timeout=10)
        assert r.status_code == 200, r.text
        assert ROGUE in workers(url, AS_ADMIN)
        r = httpx.delete(url + "/workers", params={"url": ROGUE}, headers=AS_ADMIN, timeout=10)
        assert r.status_code == 200 and workers(url, AS_USER) == before_w
    else:
        r = httpx.post(url + "/disaggregation/trusted_prefill", json={"add": ["10.0.0.5:8998"]},
                       headers=AS_ADMIN, timeout=10)
        assert r.status_code == 200 and "10.0.0.5:8998" in r.json()["trusted"]
        r = httpx.post(url + "/flush_cache", headers=AS_ADMIN, timeout=10)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("target", ["open_r", "open_d"])
@pytest.mark.parametrize("via", ["loopback", "same-host proxy"])
def test_no_admin_key_means_admin_routes_are_off(servers, target: str, via: str) -> None:
    """Finding 3: without keys, a loopback peer, directly or through a same-host TCP proxy, gets
    403 on every admin route (trust my bootstrap, flush, add a worker) and nothing changes."""
    server = servers[target]
    proxy = Proxy(server.port) if via != "loopback" else None
    url = proxy.url if proxy else server.url
    try:
        before_w, before_t = workers(servers["open_r"].url), trusted(servers["open_d"].url)
        for method, path in calls(server.server.config.app):
            r = httpx.request(method, url + path, timeout=10, **body_of(path))
            assert r.status_code == 403, (method, path, r.text)
            message = r.json()["error"]["message"]
            assert "admin routes are off" in message and "--admin-api-key" in message
        assert workers(servers["open_r"].url) == before_w
        assert trusted(servers["open_d"].url) == before_t == []
        # the read-only routes stay open
        assert httpx.get(url + ("/workers" if target == "open_r" else "/get_server_info"),
                         timeout=10).status_code == 200
    finally:
        if proxy:
            proxy.close()


def test_router_registers_prefill_with_its_admin_key(tiny_llama_dir: Path) -> None:
    """Item 2: the router's own admin call (registering its prefill bootstrap addresses with a
    decode server, when it has no cluster secret) carries its admin key; without one the decode
    server refuses it and the router says how to fix that."""
    d = ServerThread(server_app(tiny_llama_dir, api_key=API, admin_api_key=ADMIN)).start()
    routers = []
    try:
        for key in (ADMIN, None):
            cfg = router_config("http://127.0.0.9:8", d.url, api_key=API, admin_api_key=key,
                                health_check_interval_secs=0.5)
            routers.append(ServerThread(create_app(cfg)).start())
            deadline = time.monotonic() + 30
            if key:
                while "127.0.0.9:8998" not in trusted(d.url, AS_USER):
                    assert time.monotonic() < deadline, "the router never registered its prefill"
                    time.sleep(0.05)
                routers.pop().stop()  # first: its next pass would register it again
                httpx.post(d.url + "/disaggregation/trusted_prefill",
                           json={"remove": ["127.0.0.9:8998"]}, headers=AS_ADMIN, timeout=10)
            else:
                peering = routers[-1].server.config.app.state.router.peering
                while peering is None or not peering._warned:
                    assert time.monotonic() < deadline, "the refusal was never noticed"
                    time.sleep(0.05)
                assert "127.0.0.9:8998" not in trusted(d.url, AS_USER)
    finally:
        for r in routers:
            r.stop()
        d.stop()


def test_keys_come_from_flag_env_or_file_and_must_differ(tmp_path: Path) -> None:
    key_file = tmp_path / "admin"
    key_file.write_text("  from-a-file\n")
    assert admin_api_key(None, {ADMIN_KEY_FILE_ENV: str(key_file)}) == "from-a-file"
    assert admin_api_key(None, {ADMIN_KEY_ENV: "env", ADMIN_KEY_FILE_ENV: "/x"}) == "env"
    assert admin_api_key("flag", {ADMIN_KEY_ENV: "env"}) == "flag"
    assert admin_api_key(None, {}) is None
    with pytest.raises(ConfigError, match=ADMIN_KEY_FILE_ENV):
        admin_api_key(None, {ADMIN_KEY_FILE_ENV: str(tmp_path / "missing")})
    # equal keys: every API user would be an admin
    with pytest.raises(ConfigError, match="must differ from --api-key"):
        ServerArgs(api_key="same", admin_api_key="same").validate()
    with pytest.raises(ConfigError, match="must differ from --api-key"):
        parse_router_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                           "--api-key", "same", "--admin-api-key", "same"])
    with pytest.raises(ConfigError, match="--admin-api-key must not be empty"):
        ServerArgs(admin_api_key=" ").validate()
    cfg = parse_router_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                             "--admin-api-key", "a"])
    assert cfg.admin_headers() == {"authorization": "Bearer a"}


def test_startup_logs_say_how_to_turn_admin_on(tiny_llama_dir: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        server_app(tiny_llama_dir)
        create_app(router_config("http://127.0.0.1:8", "http://127.0.0.1:7"))
        server_app(tiny_llama_dir, admin_api_key=ADMIN)
    lines = [r.getMessage() for r in caplog.records if "admin routes" in r.getMessage()]
    off = [line for line in lines if "are off" in line]
    assert len(off) == 2 and all("--admin-api-key" in line and "PDSERVE_ADMIN_API_KEY" in line
                                 for line in off), lines
    assert any("POST /workers" in line for line in off)
    assert any("need 'Authorization: Bearer <--admin-api-key>'" in line for line in lines)
    assert all(ADMIN not in r.getMessage() for r in caplog.records)  # never the key itself
    # a router that can neither sign routes nor register its prefill workers says so
    with caplog.at_level(logging.WARNING, logger="pdcore.router"):
        with TestClient(create_app(router_config("http://127.0.0.1:8", "http://127.0.0.1:7"))):
            pass
    assert any("no cluster secret and no --admin-api-key" in r.getMessage()
               and "--disaggregation-trusted-prefill" in r.getMessage() for r in caplog.records)


def test_server_info_hides_the_admin_key(tiny_llama_dir: Path) -> None:
    app = server_app(tiny_llama_dir, api_key=API, admin_api_key=ADMIN)
    info = server_info(app.state.engine)
    assert info["admin_api_key"] == "***" and info["api_key"] == "***"
    client = TestClient(app)
    assert ADMIN not in client.get("/get_server_info", headers=AS_USER).text


def test_the_cluster_secret_opens_no_admin_route(tiny_llama_dir: Path) -> None:
    """With the cluster secret (and no admin key) the admin routes stay off, whatever the
    caller sends, the secret itself included; the secret does not replace the admin key."""
    secret = "the-cluster-secret"
    as_member = {"authorization": f"Bearer {secret}"}
    server = TestClient(server_app(tiny_llama_dir, disaggregation_auth_token=secret),
                        client=("127.0.0.1", 5000))
    r = server.post("/disaggregation/trusted_prefill", json={"add": ["127.0.0.1:9"]},
                    headers=as_member)
    assert r.status_code == 403 and "admin routes are off" in r.text, r.text
    assert server.get("/disaggregation/trusted_prefill").json()["trusted"] == []
    router = TestClient(create_app(router_config("http://127.0.0.1:8", "http://127.0.0.1:7",
                                                 disaggregation_auth_token=secret)),
                        client=("127.0.0.1", 5000))
    r = router.post("/workers", json={"url": ROGUE, "worker_type": "decode"}, headers=as_member)
    assert r.status_code == 403, r.text
    assert ROGUE not in {w["url"] for w in router.get("/workers").json()["workers"]}
