"""A decode server's notice of a refused route (issue 45 item 6, pdcore/route_refusal.py): it
reaches only a live prefill server announced on this host, carries the room and the reason
and nothing of D's, and P's bootstrap server acts only on a well-formed notice (with the
cluster secret's MAC when there is a secret). Real sockets on loopback, no model."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from pdcore.disagg.bootstrap import BootstrapServer
from pdcore.route_auth import announce_local_prefill, withdraw_local_prefill
from pdcore.messages.codes import ErrorCode
from pdcore.route_refusal import (
    MAC_HEADER,
    REFUSED_PATH,
    ROUTE_REFUSED,
    RefusalNotifier,
    notice_body,
    notice_mac,
    parse_notice,
    refusal_key,
    this_host,
)


class Listener:
    """An HTTP listener on loopback that records every connection and POST it gets."""

    def __init__(self) -> None:
        self.connections, self.posts = 0, []
        me = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                me.posts.append((self.path, dict(self.headers), self.rfile.read(n)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def process_request(self, request: Any, client_address: Any) -> None:
                me.connections += 1
                super().process_request(request, client_address)

        self.http = Server(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def listener():
    s = Listener()
    yield s
    s.close()


def _settle(n: RefusalNotifier, sent: int) -> None:
    deadline = time.monotonic() + 5
    while n.counts["sent"] + n.counts["failed"] < sent:
        assert time.monotonic() < deadline, n.counts
        time.sleep(0.02)


def test_a_notice_goes_only_to_a_prefill_server_announced_on_this_host(listener) -> None:
    n = RefusalNotifier("cluster-secret")
    entry = None
    try:
        # a loopback port nobody announced, and an announced port at another host: untold
        assert not n.notify("127.0.0.1", listener.port, 9, "refused")
        entry = announce_local_prefill(listener.port)
        assert entry, "cannot announce a port in this environment"
        assert not n.notify("10.77.0.1", listener.port, 9, "refused")
        assert not n.notify("prefill.example", listener.port, 9, "refused")
        assert not n.notify("127.0.0.1", listener.port, None, "refused")
        time.sleep(0.3)
        assert listener.connections == 0 and n.counts["skipped"] == 4, n.counts
        # a live prefill server of this user on this host: told once per (address, room)
        assert n.notify("127.0.0.1", listener.port, 9, "the route is refused here")
        assert not n.notify("127.0.0.1", listener.port, 9, "again")
        _settle(n, 1)
        assert n.counts["sent"] == 1 and len(listener.posts) == 1, (n.counts, listener.posts)
        path, headers, body = listener.posts[0]
        assert path == REFUSED_PATH
        assert json.loads(body) == {"room": 9, "reason": "the route is refused here"}
        # nothing of D's: no token, no control address, no KV address; the MAC proves the secret
        assert headers[MAC_HEADER] == notice_mac(refusal_key("cluster-secret"), body)
        assert b"cluster-secret" not in body and "cluster-secret" not in str(headers)
        assert parse_notice(body, headers[MAC_HEADER], "cluster-secret") == (9, "the route "
                                                                              "is refused here")
        with pytest.raises(PermissionError):
            parse_notice(body, headers[MAC_HEADER], "another secret")
    finally:
        withdraw_local_prefill(entry)
        n.close()
    assert this_host("127.0.0.1") and this_host("::1") and this_host("localhost")
    assert ROUTE_REFUSED == ErrorCode.ROUTE_REFUSED  # P's failure code is D's 403 code
    assert not this_host("10.77.0.1") and not this_host("0.0.0.0") and not this_host("x.y")


def test_bootstrap_acts_only_on_a_well_formed_authentic_notice() -> None:
    got: list[tuple[int, str]] = []
    srv = BootstrapServer("127.0.0.1", 0, "k", "rank-secret",
                          on_refused=lambda room, why: got.append((room, why)) or True)
    srv.start()
    url = f"http://127.0.0.1:{srv.port}{REFUSED_PATH}"
    client = httpx.Client(timeout=5)
    try:
        good = notice_body(5, "why\nnot")
        mac = notice_mac(refusal_key("k"), good)
        assert client.post(url, content=good).status_code == 401  # no MAC
        assert client.post(url, content=good, headers={
            MAC_HEADER: notice_mac(refusal_key("other"), good)}).status_code == 401
        for bad in (b"[1]", b"{not json", json.dumps({"room": -1}).encode(),
                    json.dumps({"room": "5"}).encode(), json.dumps({"room": 2**64}).encode()):
            r = client.post(url, content=bad,
                            headers={MAC_HEADER: notice_mac(refusal_key("k"), bad)})
            assert r.status_code == 400, (bad, r.text)
        assert client.post(url, content=b"x" * 5000).status_code == 400
        assert got == []
        r = client.post(url, content=good, headers={MAC_HEADER: mac})
        assert r.status_code == 200 and r.json() == {"room_failed": True}, r.text
        assert got == [(5, "why not")]  # control characters do not reach P's log
    finally:
        srv.close()
        client.close()
    plain = BootstrapServer("127.0.0.1", 0, None, "rank-secret")  # no handler: no such route
    plain.start()
    try:
        r = httpx.post(f"http://127.0.0.1:{plain.port}{REFUSED_PATH}", content=good, timeout=5)
        assert r.status_code == 404
    finally:
        plain.close()
