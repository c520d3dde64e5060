"""The route is not the client's to choose (issue 30, items 1 and 6): real P + D (tcp) and our
router on loopback, attacked as an outsider would.

An outsider runs a bootstrap server of its own (it answers D's route lookups with a control
address it listens on) and names it in a request to D: before the fix D resolved it, sent it its
Register (data-plane token, KV addresses) and took "KV" from it. Now the request is refused with
403 before the engine sees it, and the outsider sees no connection at all."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from pdcore.disagg.control import MAX_PEERS, ControlPlane
from pdcore.route_auth import SERVER_ID_HEADER, body_digest, route_key, sign_route
from pdcore.testing.fault_proxy import FaultProxy
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import ADMIN_HEADERS, PDCluster, ServerProcess, free_port
from pdcore.testing.tiny_models import make_tiny_model

FLAGS = ("--max-total-tokens", "2048", "--page-size", "4")
# these servers trust only what a multi-host deployment would (no loopback default: the
# router's signatures and registrations are what is under test); the seed test below runs
# with the one-host default
ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
       "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
       "PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL": "0"}
SECRET = "cluster-secret-for-the-test"
ROUTES = {"/generate": {"text": "hello there", "sampling_params": {"max_new_tokens": 4,
                                                                   "temperature": 0}},
          "/v1/completions": {"prompt": "hello there", "max_tokens": 4, "temperature": 0},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 4, "temperature": 0}}


class Outsider:
    """A bootstrap server of the attacker's and the control socket it advertises; records every
    TCP connection and every control-plane frame that reaches them."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        zport = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.connections = 0
        outsider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # answers like a complete prefill instance
                info = {"rank_ip": "127.0.0.1", "rank_port": zport} if "=-1" not in self.path \
                    else {"tp_size": 1, "dp_size": 1, "page_size": 4, "kv_cache_dtype":
                          "float32", "instance_id": "evil"}
                data = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-PD-Instance", "evil")
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def process_request(self, request: Any, client_address: Any) -> None:
                outsider.connections += 1
                super().process_request(request, client_address)

        self.http = Server(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def frames(self, wait_ms: int = 300) -> list[list[bytes]]:
        out = []
        while self.pull.poll(wait_ms):
            out.append(self.pull.recv_multipart())
        return out

    def close(self) -> None:
        self.http.shutdown()
        self.pull.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pdcore.engine.model.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("trust") / "m"), hidden=64, layers=2,
                           tokenizer_from=default_model_file())


@pytest.fixture
def outsider():
    o = Outsider()
    yield o
    o.close()


@pytest.fixture(scope="module")
def open_pair(model_dir):
    """No cluster secret: our router registers P's bootstrap address with D."""
    c = PDCluster("tcp", model_path=model_dir, flags=FLAGS, env=ENV).start()
    yield c
    c.stop()


def _refused(r: httpx.Response, what: str) -> None:
    assert r.status_code == 403, (r.status_code, r.text)
    assert what in r.json()["error"]["message"], r.text
    # #46: the reason a router acts on is machine-readable, not the message's text
    assert r.json()["error"]["code"] == "route_refused", r.text


def test_forged_bootstrap_gets_403_and_nothing_is_sent(open_pair, outsider) -> None:
    c = open_pair
    d, p = c.decodes[0], c.prefills[0]
    for route, body in ROUTES.items():
        forged = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": outsider.port,
                  "bootstrap_room": 4242}
        _refused(httpx.post(d.url + route, json=forged, timeout=30), "neither signed nor")
        _refused(httpx.post(p.url + route, json=forged, timeout=30), "neither signed nor")
        # a list of routes with one forged entry among real ones is refused whole
        batch = {**forged, "bootstrap_host": ["127.0.0.1"], "bootstrap_port": [outsider.port],
                 "bootstrap_room": [7]}
        if route == "/generate":
            _refused(httpx.post(d.url + route, json=batch, timeout=30), "neither signed nor")
    time.sleep(1.5)  # a resolver thread would have connected by now
    assert outsider.connections == 0 and outsider.frames() == [], "decode contacted the outsider"
    metrics = httpx.get(d.url + "/metrics", timeout=10).text
    assert "pdserve_routes_refused_total 4.0" in metrics, metrics[-2000:]
    c.wait_pages_free()
    r = httpx.post(c.url + "/generate", json=ROUTES["/generate"], timeout=120)
    assert r.status_code == 200 and r.json()["output_ids"], (r.text, c.router.log()[-3000:])


def test_warmup_host_is_not_the_clients(open_pair) -> None:
    """2.2.2.2 makes a decode room that takes no KV: a client naming it would decode over pages
    another request left behind."""
    body = {**ROUTES["/generate"], "bootstrap_host": "2.2.2.2", "bootstrap_room": 5}
    for s in (open_pair.decodes[0], open_pair.prefills[0]):
        _refused(httpx.post(s.url + "/generate", json=body, timeout=30), "warm-up")
    assert httpx.get(open_pair.decodes[0].url + "/health_generate", timeout=60).status_code == 200


def test_trust_registration_is_validated(open_pair) -> None:
    url = open_pair.decodes[0].url + "/disaggregation/trusted_prefill"
    for bad in ({"add": ["no-port"]}, {"add": "127.0.0.1:1"}, {"add": ["x:1"] * 300}, [1]):
        r = httpx.post(url, json=bad, timeout=10, headers=ADMIN_HEADERS)
        assert r.status_code == 400, (bad, r.text)
    r = httpx.post(url, json={"add": ["10.9.8.7:8998"], "remove": []}, timeout=10,
                   headers=ADMIN_HEADERS)
    assert r.status_code == 200 and "10.9.8.7:8998" in r.json()["trusted"]
    r = httpx.post(url, json={"remove": ["10.9.8.7:8998"]}, timeout=10, headers=ADMIN_HEADERS)
    assert "10.9.8.7:8998" not in r.json()["trusted"]


def _refused_count(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_routes_refused_total "):
            return float(line.split()[1])
    return 0.0


def test_a_decode_that_forgot_the_prefill_is_told_again(open_pair) -> None:
    """A restarted decode server trusts nothing until the router tells it again: the router
    answers the 403 by registering the prefill addresses with it and retrying, so the client
    sees 200 (no circuit counts it)."""
    c = open_pair
    d = c.decodes[0]
    addr = f"127.0.0.1:{c.bootstrap_ports[0]}"
    before, refused = _refused_count(d.url), False
    for _ in range(3):  # the router's periodic pass may re-register first: try again then
        r = httpx.post(d.url + "/disaggregation/trusted_prefill", json={"remove": [addr]},
                       timeout=10, headers=ADMIN_HEADERS)
        assert addr not in r.json()["trusted"]
        r = httpx.post(c.url + "/generate", json=ROUTES["/generate"], timeout=120)
        assert r.status_code == 200, r.text
        refused = _refused_count(d.url) > before
        if refused:
            break
    assert refused, "the decode server never refused the route: nothing was tested"
    workers = httpx.get(c.url + "/workers", timeout=10).json()["workers"]
    assert all(w["circuit"]["state"] == "closed" and w["circuit"]["total_failures"] == 0
               for w in workers), workers


def test_a_new_router_tells_decode_before_its_first_route(open_pair) -> None:
    """A router that just started (or a decode worker that just became healthy) registers the
    prefill addresses before it routes there, not on its next periodic pass: the first request,
    sent the moment /health answers and with no retries, is served (CI once saw it refused)."""
    c = open_pair
    addr = f"127.0.0.1:{c.bootstrap_ports[0]}"
    r = httpx.post(c.decodes[0].url + "/disaggregation/trusted_prefill",
                   json={"remove": [addr]}, timeout=10, headers=ADMIN_HEADERS)
    assert addr not in r.json()["trusted"]
    router = ServerProcess(  # a 60 s health interval: its periodic pass comes 5 s late
        "--pd-disaggregation", "--prefill", c.prefills[0].url, str(c.bootstrap_ports[0]),
        "--decode", c.decodes[0].url, "--disable-retries", "--health-check-interval-secs", "60",
        command=("-m", "pdcore.router"), env=c.env)
    try:
        router.wait_healthy(120)
        r = httpx.post(router.url + "/generate", json=ROUTES["/generate"], timeout=120)
        assert r.status_code == 200, r.text
    finally:
        router.stop()


@pytest.fixture(scope="module")
def signed_pair(model_dir, tmp_path_factory):
    """A cluster secret everywhere: the router signs its routes, D also trusts one address of
    the outsider's (a misconfiguration) so the challenge has something to refuse."""
    o = Outsider()
    c = PDCluster("tcp", model_path=model_dir, flags=FLAGS, env=ENV, secret=SECRET,
                  decode_flags=("--disaggregation-trusted-prefill", f"127.0.0.1:{o.port}"))
    try:
        c.start()
        yield c, o
    finally:
        c.stop()
        o.close()


def test_signed_routes(signed_pair) -> None:
    """v2 signatures (route_auth): the router's route serves; what D refuses with 403 before
    admission: no signature, an expired or too long-lived one, another room, a route signed
    for another decode server or for another request body (a copied route), a v1 signature,
    a malformed one, another cluster's."""
    c, _ = signed_pair
    d = c.decodes[0]
    r = httpx.post(c.url + "/generate", json=ROUTES["/generate"], timeout=120)
    assert r.status_code == 200 and r.json()["output_ids"], r.text
    # every route's body, a batch (one signature per room) and chat with n > 1 verify on P and D
    bodies = [*ROUTES.items(), ("/generate", {**ROUTES["/generate"], "text": ["a b", "c d"]}),
              ("/v1/chat/completions", {**ROUTES["/v1/chat/completions"], "n": 2,
                                        "temperature": 0.5, "top_p": 0.9})]
    for route, body in bodies:
        r = httpx.post(c.url + route, json=body, timeout=120)
        assert r.status_code == 200, (route, r.text)
    d_id = httpx.get(d.url + "/health", timeout=10).headers[SERVER_ID_HEADER]
    key = route_key(SECRET)
    route = {"bootstrap_host": "127.0.0.1", "bootstrap_port": c.bootstrap_ports[0],
             "bootstrap_room": 99}
    body = {**ROUTES["/generate"], **route}
    digest = body_digest(body)

    def sig(room=99, target=d_id, dig=digest, k=key, **kw) -> str:
        return sign_route(k, room, "127.0.0.1", route["bootstrap_port"], target, dig, **kw)

    other_body = body_digest({**body, "text": "another prompt"})
    cases = {"neither signed nor": None,  # the real P, but unsigned: no registration here
             "expired": sig(ttl_s=-40),  # past the 30 s skew
             "too far in the future": sig(ttl_s=600),
             "does not sign this route": sig(room=98),
             "for another decode server": sig(target="another0decode"),
             "does not sign this route and request": sig(dig=other_body),
             "v1 signature": "v1.%d.%s" % (time.time() + 30, "0" * 64),
             "malformed": "v2.x.y",
             "does not sign": sig(k=route_key("another secret"))}
    for why, extra in cases.items():
        sent = {**body, **({"bootstrap_sig": extra} if extra else {})}
        _refused(httpx.post(d.url + "/generate", json=sent, timeout=30), why)


def test_secret_never_goes_to_an_address_that_cannot_prove_it(signed_pair) -> None:
    """D trusts the outsider's address (misconfigured), so it resolves it; but before D sends
    anything about its memory, the 'prefill rank' must answer a nonce with the cluster MAC."""
    c, o = signed_pair
    body = {**ROUTES["/generate"], "bootstrap_host": "127.0.0.1", "bootstrap_port": o.port,
            "bootstrap_room": 31337}
    r = httpx.post(c.decodes[0].url + "/generate", json=body, timeout=60)
    assert r.status_code >= 500 and "did not prove" in r.text, r.text
    frames = o.frames()
    kinds = [msgspec.msgpack.decode(f[0])["t"] for f in frames]
    assert kinds and set(kinds) == {"hello"}, kinds  # no Register: no endpoint, no KV address
    assert all(SECRET.encode() not in b"".join(f) for f in frames)
    metrics = httpx.get(c.decodes[0].url + "/metrics", timeout=10).text
    assert "pdserve_scheduler_kv_pairing_refused_total" in metrics
    c.wait_pages_free()


def _pairs_and_metric(url: str) -> tuple[list[dict[str, Any]], float]:
    pairs = httpx.get(url + "/workers", timeout=10).json()["pairs"]
    opened = [line for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
              if line.startswith("pdrouter_pair_circuits_open ")]
    return pairs, float(opened[0].split()[1])


def test_a_cut_prefill_decode_link_is_avoided(signed_pair) -> None:
    """A P-D partition (router/pairs.py, #49): the router reaches the prefill server also as a
    second worker through fault proxies on its HTTP and bootstrap ports; that bootstrap link
    is cut (D is refused there; D and the router stay healthy to each other). D fails that
    pair's rooms (502 peer_failed), the router retries them on the direct pairing, and after
    the default --pair-cb-failure-threshold (3) it no longer tries the cut pair (one trial per
    --pair-cb-timeout-duration-secs, 30 s). Every answer is 200 with the same greedy ids."""
    c, _ = signed_pair
    http_proxy = FaultProxy("127.0.0.1", free_port(), "127.0.0.1", c.prefills[0].port).start()
    boot = FaultProxy("127.0.0.1", free_port(), "127.0.0.1", c.bootstrap_ports[0]).start()
    boot.refuse = True
    cut = f"http://127.0.0.1:{http_proxy.listen[1]}"
    r = httpx.post(c.url + "/workers", json={"url": cut, "worker_type": "prefill",
                                             "bootstrap_port": boot.listen[1]},
                   headers=ADMIN_HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    want: list[int] | None = None

    def serve() -> None:
        nonlocal want
        r = httpx.post(c.url + "/generate", json=ROUTES["/generate"], timeout=120)
        assert r.status_code == 200, (r.text, c.router.log()[-3000:])
        want = want or r.json()["output_ids"]
        assert r.json()["output_ids"] == want

    try:
        for _ in range(12):  # round robin: the cut pair comes every other request
            began = time.monotonic()  # the pair opens after this
            serve()
            pairs, _ = _pairs_and_metric(c.url)
            if pairs and pairs[0]["state"] == "open":
                break
        (pair,) = pairs
        assert (pair["prefill"], pair["state"], pair["total_failures"]) == (cut, "open", 3), pair
        assert "cannot bootstrap" in pair["last_error"], pair  # D's reason, through P's name
        for _ in range(5):
            serve()
        (pair,), open_now = _pairs_and_metric(c.url)
        # nothing tried the cut pair since, but one trial per 30 s cool-down that passed
        assert pair["total_failures"] - 3 <= (time.monotonic() - began) // 30, pair
        assert open_now == (pair["state"] == "open") and pair["state"] != "closed"
    finally:
        httpx.delete(c.url + "/workers", params={"url": cut}, headers=ADMIN_HEADERS, timeout=30)
        http_proxy.stop()
        boot.stop()
    assert _pairs_and_metric(c.url) == ([], 0.0)  # the removed worker's pairs went with it
    c.wait_pages_free()


def test_a_prefill_with_other_weights_is_refused_on_both_sides(tmp_path) -> None:
    """Same architecture and file sizes, other weights: KV from it would decode as wrong text
    that looks fine. The pairing fails with the reason, counted by P and D."""
    from pdcore.engine.model.tokenizer import default_model_file

    tok = default_model_file()
    a = make_tiny_model(str(tmp_path / "a"), hidden=64, layers=2, seed=1, tokenizer_from=tok)
    b = make_tiny_model(str(tmp_path / "b"), hidden=64, layers=2, seed=2, tokenizer_from=tok)
    c = PDCluster("tcp", flags=FLAGS, env=ENV, prefill_flags=("--model-path", a),
                  decode_flags=("--model-path", b)).start()
    try:
        r = httpx.post(c.url + "/generate", json={**ROUTES["/generate"]}, timeout=120)
        assert r.status_code >= 400 and "another model" in r.text, r.text
        for s in (c.decodes[0], c.prefills[0]):
            deadline = time.monotonic() + 20
            while "pdserve_scheduler_kv_pairing_refused_total 0" in (
                    m := httpx.get(s.url + "/metrics", timeout=10).text) or \
                    "pairing_refused_total" not in m:
                assert time.monotonic() < deadline, (s.url, m[-1500:])
                time.sleep(0.3)
        c.wait_pages_free()
    finally:
        c.stop()


def test_reply_sockets_are_bounded() -> None:
    """P answers at the address a message names: the sockets it opens for that are bounded."""
    cp = ControlPlane("127.0.0.1", None, "t", lambda m: None, lambda: None)
    cp.start()
    try:
        for i in range(MAX_PEERS + 40):
            cp.send_raw(f"tcp://127.0.0.1:{1024 + i}", [b"x"])
        assert cp.peer_sockets() == MAX_PEERS
        assert cp.counters.snapshot()["peer_sockets_evicted"] == 40
    finally:
        cp.close()


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router is not installed (pip install sglang-router)")
def test_sglang_router_needs_one_setting(model_dir) -> None:
    """sglang-router neither signs routes nor registers addresses: decode servers started with
    --disaggregation-trusted-prefill (PDCluster does that for it) serve through it."""
    c = PDCluster("tcp", model_path=model_dir, flags=FLAGS, env=ENV, router="sglang").start()
    try:
        assert "--disaggregation-trusted-prefill" in c.decodes[0].flags
        r = httpx.post(c.url + "/generate", json=ROUTES["/generate"], timeout=120)
        assert r.status_code == 200 and r.json()["output_ids"], r.text
    finally:
        c.stop()


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router is not installed (pip install sglang-router)")
def test_seed_commands_serve_behind_sglang_router_as_written(model_dir, outsider) -> None:
    """Issue 45 item 6: the seed page's one-host Llama commands (program name swapped, the
    RDMA device dropped, a free bootstrap port instead of 8998 so CI runs side by side, the
    tiny model) behind the real sglang-router serve transformers' greedy tokens with no extra
    flag: P announces its bootstrap port to this user's servers on this host, D trusts that
    loopback address. The client-named route stays closed: a loopback port nobody announced
    and a non-loopback address are refused (403) and never contacted. With the loopback
    default off (D then trusts no route, as across hosts without a secret or trust list), a
    refused route answers the client with decode's reason at once, behind sglang-router and
    behind pdserve's router: D tells P (its prefill server on this host), P fails the room
    and answers, so nothing waits for P's claim timeout (5 s; sglang-router tried 5 times:
    26 s before) and P holds no room afterwards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bport = free_port()
    p = ServerProcess("--model-path", model_dir, "--disaggregation-mode", "prefill",
                      "--disaggregation-bootstrap-port", str(bport), *FLAGS)
    d = ServerProcess("--model-path", model_dir, "--disaggregation-mode", "decode", *FLAGS)
    procs = [p, d]
    try:
        p.wait_healthy(300)
        d.wait_healthy(300)
        router = ServerProcess(
            "--pd-disaggregation", "--prefill", p.url, str(bport), "--decode", d.url,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            command=("-m", "sglang_router.launch_router"))
        procs.append(router)
        router.wait_healthy(120)
        ids = AutoTokenizer.from_pretrained(model_dir).encode("The capital of France is")
        r = httpx.post(router.url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
            timeout=120)
        assert r.status_code == 200, r.text
        ref = hf_greedy(AutoModelForCausalLM.from_pretrained(model_dir), ids, 8)
        check_greedy(r.json()["output_ids"], ref)
        for host, port in (("127.0.0.1", outsider.port), ("10.77.0.1", 8998)):
            body = {**ROUTES["/generate"], "bootstrap_host": host, "bootstrap_port": port,
                    "bootstrap_room": 4243}
            _refused(httpx.post(d.url + "/generate", json=body, timeout=30), "neither signed nor")
        assert outsider.connections == 0
        d.stop()  # the same decode server, multi-host style: no loopback default
        d = ServerProcess("--model-path", model_dir, "--disaggregation-mode", "decode", *FLAGS,
                          port=d.port, env={"PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL": "0"})
        procs.append(d)
        d.wait_healthy(300)
        ours = ServerProcess(  # no admin key: it cannot register P with D, D keeps refusing
            "--pd-disaggregation", "--prefill", p.url, str(bport), "--decode", d.url,
            command=("-m", "pdcore.router"), admin_key=None)
        procs.append(ours)
        ours.wait_healthy(120)
        took = {}
        for name, url, stream in (("sglang-router", router.url, False),
                                  ("sglang-router stream", router.url, True),
                                  ("pdserve router", ours.url, False)):
            started = time.monotonic()
            r = httpx.post(url + "/generate", json={**ROUTES["/generate"], "stream": stream},
                           timeout=120)
            took[name] = round(time.monotonic() - started, 2)
            assert r.status_code >= 400 and "neither signed nor" in r.text, (name, r.text)
            assert took[name] < 5, took  # under P's one claim timeout (5 s)
        assert r.status_code == 403, r.text  # ours passes decode's answer on
        print(f"refused route answered in {took} s")
        deadline = time.monotonic() + 90  # 30 s ran out once under a loaded CI (s13)
        while True:  # every room P had ended on decode's notice, none at the claim timeout
            m = {line.split()[0]: float(line.split()[-1]) for line in httpx.get(
                p.url + "/metrics", timeout=10).text.splitlines()
                if line.startswith("pdserve_scheduler_kv_")}
            if m.get("pdserve_scheduler_kv_refused_rooms_total", 0) >= 7 and \
                    load_at_rest(httpx.get(p.url + "/get_load", timeout=10).json()[0]):
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.2)
        assert not m.get("pdserve_scheduler_kv_unclaimed_rooms_total"), m
    finally:
        for s in procs:
            s.stop()
