"""Several routers over the same workers (`--peer-routers`, pdcore/router/fleet.py), on fake
workers: an admin change made on one router reaches the others, a router started later (or
restarted from its original command line) takes over a running peer's worker list, and each
router routes requests on its own. The same with real servers and a router killed: the
`--routers 2` part of tests/pd/test_up_supervision.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from fake_workers import FakeWorker, ServerThread
from pdserve_testing import free_port

from pdcore.errors import ConfigError
from pdcore.router.app import create_app
from pdcore.router.cli import parse_router_args
from pdcore.router.config import RouterConfig
from pdcore.router import fleet as fleet_module
from pdcore.router.fleet import PEER_HEADER

ADMIN, API = "fleet-admin-key", "fleet-api-key"
BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}


class Router:
    def __init__(self, port: int, prefill: list[FakeWorker], decode: list[FakeWorker],
                 peers: list[str], **flags: object) -> None:
        cfg = RouterConfig(pd_disaggregation=True, prefill=[(w.url, 8998) for w in prefill],
                           decode=[w.url for w in decode], policy="round_robin",
                           api_key=API, admin_api_key=ADMIN, peer_routers=peers,
                           request_timeout_secs=20.0, **flags)  # type: ignore[arg-type]
        self.app = create_app(cfg)
        self.server = ServerThread(self.app, port).start()
        self.url = self.server.url
        self.http = httpx.Client(base_url=self.url, timeout=20,
                                 headers={"authorization": f"Bearer {ADMIN}"})

    def workers(self) -> dict[str, str]:
        return {w["url"]: w["worker_type"] for w in self.http.get("/workers").json()["workers"]}

    def stop(self) -> None:
        self.http.close()
        self.server.stop()


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[list[FakeWorker], list[Router], list[int]]]:
    # the first router finds no peer up: it asks again ADOPT_TRIES times (1 s apart in use)
    monkeypatch.setattr(fleet_module, "ADOPT_PAUSE_S", 0.05)
    workers = [FakeWorker(role=r, name=f"{r[0]}{i}").start()
               for i, r in enumerate(("prefill", "decode", "decode", "decode"))]
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    routers = [Router(ports[k], workers[:1], workers[1:2], [u for u in urls if u != urls[k]])
               for k in range(2)]
    yield workers, routers, ports
    for r in routers:
        r.stop()
    for w in workers:
        w.stop()


def _wait(pred, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_admin_changes_reach_every_router_and_a_late_router_takes_the_list(fleet) -> None:
    (p0, d0, d1, d2), (a, b), ports = fleet
    for r in (a, b):
        _wait(lambda r=r: r.http.get("/health").status_code == 200, f"{r.url} not healthy")
    # each router serves on its own
    for r in (a, b):
        assert r.http.post("/generate", json=BODY).status_code == 200
    # a worker added on A is on B too; the answer says which peers took it
    resp = a.http.post("/workers", json={"url": d1.url, "worker_type": "decode"})
    assert resp.status_code == 200, resp.text
    third = f"http://127.0.0.1:{ports[2]}"  # the third router: not started yet
    assert resp.json()["peers"][b.url] == "ok", resp.text
    assert "ConnectError" in resp.json()["peers"][third], resp.text
    assert b.workers() == {p0.url: "prefill", d0.url: "decode", d1.url: "decode"}
    # removed on B (the path form): gone from A as well
    resp = b.http.delete(f"/workers/{d0.url}")
    assert resp.status_code == 200 and resp.json()["peers"][a.url] == "ok", resp.text
    assert a.workers() == {p0.url: "prefill", d1.url: "decode"}
    # the legacy forms relay too
    resp = a.http.post("/add_worker", params={"url": d2.url, "worker_type": "decode"})
    assert resp.status_code == 200 and resp.json()["peers"][b.url] == "ok", resp.text
    assert d2.url in b.workers()
    resp = b.http.post("/remove_worker", params={"url": d2.url})
    assert resp.status_code == 200 and d2.url not in a.workers()
    # a router started (again) from the original command line (P0, D0) with A as its peer
    # takes A's list over: D0 removed, D1 added; and it serves with it
    c = Router(ports[2], [p0], [d0], [a.url, b.url])
    try:
        _wait(lambda: c.workers() == {p0.url: "prefill", d1.url: "decode"},
              f"C did not take A's list: {c.workers()}")
        listed = c.http.get("/workers").json()
        assert listed["fleet"]["adopted_from"] == a.url, listed
        _wait(lambda: c.http.get("/health").status_code == 200, "C not healthy")
        before = (len(d0.received), len(d1.received))
        assert c.http.post("/generate", json=BODY).status_code == 200
        assert (len(d0.received), len(d1.received)) == (before[0], before[1] + 1)
    finally:
        c.stop()
    # C is gone again: a change on A holds there and on B, and A counts what C missed
    resp = a.http.post("/workers", json={"url": d2.url, "worker_type": "decode"})
    assert resp.status_code == 200 and resp.json()["peers"][b.url] == "ok", resp.text
    assert "ConnectError" in resp.json()["peers"][third] and d2.url in b.workers()
    assert a.http.get("/workers").json()["fleet"]["relay_failures"] >= 2


def test_a_relayed_change_is_not_relayed_again_and_still_needs_the_admin_key(fleet) -> None:
    (p0, d0, d1, _), (a, b), _ = fleet
    # the peer header does not open an admin route: without the admin key it is 401/403
    resp = httpx.post(a.url + "/workers", json={"url": d1.url, "worker_type": "decode"},
                      headers={PEER_HEADER: "1"}, timeout=20)
    assert resp.status_code in (401, 403) and d1.url not in a.workers()
    resp = httpx.post(a.url + "/workers", json={"url": d1.url, "worker_type": "decode"},
                      headers={PEER_HEADER: "1", "authorization": f"Bearer {API}"}, timeout=20)
    assert resp.status_code == 403 and d1.url not in a.workers(), resp.text
    # with the key and the header (what a peer sends): applied here, not relayed to B
    resp = a.http.post("/workers", json={"url": d1.url, "worker_type": "decode"},
                       headers={PEER_HEADER: "1"})
    assert resp.status_code == 200 and "peers" not in resp.json(), resp.text
    assert d1.url in a.workers() and d1.url not in b.workers()
    # a refused change is not relayed either (409: already there)
    resp = a.http.post("/workers", json={"url": d1.url, "worker_type": "decode"})
    assert resp.status_code == 409 and "peers" not in resp.json()
    assert d1.url not in b.workers()


def test_peer_routers_flag() -> None:
    cfg = parse_router_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                             "--peer-routers", "http://127.0.0.1:3/", "http://127.0.0.1:4"])
    assert cfg.peer_routers == ["http://127.0.0.1:3", "http://127.0.0.1:4"]
    with pytest.raises(ConfigError, match="not workers"):
        parse_router_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                           "--peer-routers", "http://127.0.0.1:2"])
    with pytest.raises(ConfigError, match="drop --peer-routers"):
        parse_router_args(["--service-discovery", "--prefill-selector", "r=p",
                           "--decode-selector", "r=d", "--peer-routers", "http://127.0.0.1:3"])


def test_a_client_side_list_leaves_a_router_that_is_down_or_frozen(fleet) -> None:
    """pdcore.testing.router_list: a refused connection and a router that accepts but sends
    nothing (SIGSTOPped: its kernel still accepts) both send the request to the next router;
    an HTTP answer is final; no router at all is the last failure's name."""
    import socket

    from pdcore.testing.router_list import RouterList

    _, (a, _b), ports = fleet
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # never accepts: connects complete, no byte ever comes
    stuck, down = f"http://127.0.0.1:{frozen.getsockname()[1]}", f"http://127.0.0.1:{ports[2]}"
    # stall_s bounds a wait for the next bytes; a non-streamed answer sends none until it is
    # done, so 2 s (not 0.5) keeps a healthy but loaded router from counting as frozen
    try:
        with httpx.Client(headers={"authorization": f"Bearer {API}"}) as http:
            for stream in (False, True):
                got = RouterList([down, stuck, a.url], timeout=10, stall_s=2.0).generate(
                    http, {**BODY, "stream": stream})
                assert (got.status, got.router, got.fell_over) == (200, a.url, 2), got
            none = RouterList([down, stuck], timeout=10, stall_s=2.0).generate(http, BODY)
            assert none.status == "hung" and none.router == "" and none.fell_over == 2, none
            bad = RouterList([a.url, down]).generate(http, {"text": 1})
            assert bad.status == 400 and bad.router == a.url and bad.fell_over == 0, bad
    finally:
        frozen.close()


def test_routers_that_missed_relays_converge_within_one_sync_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two routers (same cluster secret) that reach each other only through fault proxies: while
    the link is refused each takes an admin change the other misses (A adds D1 and removes D0,
    B adds D2); once it is back, within one --peer-sync-interval-secs (+ slack) both hold the
    same list, the removal included (its tombstone wins over B's older entry). A ledger
    signed with another secret is refused and changes nothing."""
    from pdcore.router.fleet_sync import SIG_HEADER
    from pdcore.testing.fault_proxy import FaultProxy

    monkeypatch.setattr(fleet_module, "ADOPT_PAUSE_S", 0.05)
    period = 0.5
    p0, d0, d1, d2 = [FakeWorker(role=r, name=f"{r[0]}{i}").start()
                      for i, r in enumerate(("prefill", "decode", "decode", "decode"))]
    ports = [free_port() for _ in range(4)]  # A, B, proxy to A, proxy to B
    proxies = [FaultProxy("127.0.0.1", ports[2 + k], "127.0.0.1", ports[k]).start()
               for k in range(2)]
    via = [f"http://127.0.0.1:{ports[2 + k]}" for k in range(2)]
    flags = {"peer_sync_interval_secs": period, "disaggregation_auth_token": "fleet-secret-1"}
    a = Router(ports[0], [p0], [d0], [via[1]], **flags)
    b = Router(ports[1], [p0], [d0], [via[0]], **flags)
    try:
        for proxy in proxies:  # the link cut: new connections and the kept-alive ones
            proxy.refuse = True
            proxy.reset_all()
        resp = a.http.post("/workers", json={"url": d1.url, "worker_type": "decode"})
        assert resp.status_code == 200 and resp.json()["peers"][via[1]] != "ok", resp.text
        assert a.http.delete(f"/workers/{d0.url}").status_code == 200
        assert b.http.post("/workers", json={"url": d2.url, "worker_type": "decode"}
                           ).status_code == 200
        time.sleep(2 * period)  # syncs fail while cut off: nothing changes
        assert b.workers() == {p0.url: "prefill", d0.url: "decode", d2.url: "decode"}
        assert a.workers() == {p0.url: "prefill", d1.url: "decode"}
        for proxy in proxies:
            proxy.refuse = False
        healed = time.monotonic()
        want = {p0.url: "prefill", d1.url: "decode", d2.url: "decode"}
        _wait(lambda: a.workers() == want and b.workers() == want,
              f"not converged: A {a.workers()}, B {b.workers()}", timeout=period + 5)
        took = time.monotonic() - healed
        fleet_a = a.http.get("/workers").json()["fleet"]
        assert fleet_a["signed"] and fleet_a["changes_taken"] == 1 and fleet_a["syncs"] >= 1
        assert fleet_a["sync_failures"] >= 1, fleet_a  # the refused link was counted
        # the ledger route is the admin's, and its answer is signed
        assert httpx.get(a.url + "/fleet/ledger", timeout=10).status_code in (401, 403)
        ledger = a.http.get("/fleet/ledger")
        assert ledger.status_code == 200 and len(ledger.headers[SIG_HEADER]) == 64
        tomb = {e["url"]: e for e in ledger.json()["entries"]}[d0.url]
        assert tomb["present"] is False and tomb["stamp"] > 0
        # a router with another secret: its ledger is refused, its list stays its own
        c = Router(free_port(), [p0], [d0], [a.url], peer_sync_interval_secs=period,
                   disaggregation_auth_token="another-secret")
        try:
            time.sleep(3 * period)
            got = c.http.get("/workers").json()["fleet"]
            assert got["syncs"] == 0 and got["sync_failures"] >= 1, got
            assert c.workers() == a.workers()  # (the start-up list still comes from A)
        finally:
            c.stop()
        print(f"converged {took:.2f} s after the link came back (period {period} s)")
    finally:
        for r in (a, b):
            r.stop()
        for proxy in proxies:
            proxy.stop()
        for w in (p0, d0, d1, d2):
            w.stop()


def test_a_hostile_peer_ledger_is_dropped_whole() -> None:
    """What a peer sends is bounded and checked: one bad entry drops the whole answer."""
    import json as _json

    from pdcore.router.fleet_sync import MAX_ENTRIES, MAX_FUTURE_S, BadLedger, parse_entries

    now = time.time()
    good = {"url": "http://127.0.0.1:9/", "stamp": now, "present": True, "role": "prefill",
            "bootstrap_port": 8998}
    got = parse_entries(_json.dumps({"entries": [good]}).encode(), now)
    assert list(got) == ["http://127.0.0.1:9"] and got["http://127.0.0.1:9"].port == 8998
    bad = [{"stamp": now + MAX_FUTURE_S + 10}, {"stamp": float("nan")}, {"stamp": True},
           {"url": "file:///etc/passwd"}, {"url": "http://h:1?x=1"}, {"url": "x" * 5000},
           {"role": "router"}, {"present": "yes"}, {"bootstrap_port": 70000},
           {"role": "decode"}]  # a decode worker has no bootstrap port
    for change in bad:
        with pytest.raises(BadLedger):
            parse_entries(_json.dumps({"entries": [good, {**good, **change}]}).encode(), now)
    for raw in (b"[]", b"{", b'{"entries": 3}', b'{"entries": [1]}',
                _json.dumps({"entries": [good] * (MAX_ENTRIES + 1)}).encode(),
                b" " * (2 << 20)):
        with pytest.raises(BadLedger):
            parse_entries(raw, now)
