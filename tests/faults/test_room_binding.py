"""One decode server per room, bound to its prompt (issue 44 item 1): real P and two D servers
on loopback, the attacker talking to them directly as an outsider with a copied route would.

The victim's route (room, and with a cluster secret a valid signature) is copied into a request
to the other decode server, carrying another prompt: P refuses to send that server anything
(the room is bound to the first decode server that claimed it, 409 `room_claimed`), and when the
copy claims first, P compares the digest of decode's whole prompt with its own before any page
leaves (409 `prompt_mismatch` on both sides). Transfer counters prove that no byte moved.

With a cluster secret the router's signature (route_auth v2) names the decode server it chose
and covers the request body: the copy is refused by the decode server's HTTP edge with 403,
before admission, and never reaches P.

Orphan rooms (issue 44 item 7): requests sent to a decode server alone, naming the real P, hold
none of its pages (D reserves only once P confirmed it has the request) and fail within a few
seconds; another user's request completes meanwhile.

The acceptance matrix (tcp and shm x with and without --api-key x with and without the cluster
secret) on two clusters: `tcp-open` (no key, no secret) and `shm-key-secret` (--api-key and the
secret; the attacker is a tenant holding an API key). On the second one each attack is also
sent unsigned, as a server without a secret takes it (a loopback route to a live prefill of
this host, trusted by its announcement; with a secret only when the operator sets
PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL=1, as this cluster does): that is the no-secret
path on shm with --api-key. Without that opt-in, a secret cluster refuses unsigned routes at
HTTP (test_trust_units.test_a_secret_refuses_unsigned_loopback_routes). The
axes are independent layers: --api-key is an HTTP check made before and apart from the route
check (a key holder's request then goes on exactly as one without --api-key does); the secret
decides how the route is trusted at HTTP (signed or not: both sent here) and whether control
messages carry MACs (on one cluster, off on the other); the backend only carries pages, after
P's claim, binding and digest checks, which live in the backend-independent KV managers and
which both backends' transfer counters show refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from pdcore.route_auth import SERVER_ID_HEADER, body_digest, route_key, sign_route
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import PDCluster

pytestmark = pytest.mark.timeout(300)
FLAGS = ("--max-total-tokens", "2048", "--page-size", "4", "--skip-server-warmup")
SECRET = "room-binding-secret"
KEY = "sk-tenant-key"
VICTIM = "The secret code of the vault is 4711. Repeat the code:"
OTHER = "Tell me a story about a cat"


@pytest.fixture(scope="module", params=[("tcp", None, None), ("shm", SECRET, KEY)],
                ids=["tcp-open", "shm-key-secret"])
def trio(request, tiny_llama_dir: Path):
    backend, secret, key = request.param
    c = PDCluster(backend, decode=2, model_path=str(tiny_llama_dir), flags=FLAGS,
                  secret=secret, api_key=key, env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
                                      "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
                                      "PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT": "1",
                                      "PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL": "1"})
    c.start(300)
    yield c
    c.stop()


def _metric(c: PDCluster, url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", headers=c.headers, timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _body(c: PDCluster, room: int, text: str, signed_for: str | None = None) -> dict:
    """A request naming the real P's route, signed as the router signs it for the decode
    server `signed_for` (its server id) when given (the victim's, or a copy of it)."""
    body = {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": c.bootstrap_ports[0],
            "bootstrap_room": room}
    if signed_for is not None:
        body["bootstrap_sig"] = sign_route(route_key(SECRET), room, "127.0.0.1",
                                           c.bootstrap_ports[0], signed_for, body_digest(body))
    return body


def _server_id(url: str) -> str:
    return httpx.get(url + "/health", timeout=10).headers[SERVER_ID_HEADER]


BYTES = "pdserve_kv_transfer_bytes_total"


def test_a_copied_route_gets_nothing(trio: PDCluster) -> None:
    """The victim's decode server claims the room first. With the secret, the victim's signed
    route copied into a request with another prompt is refused by either decode server's HTTP
    edge (403: signed for another decode server / for another request) and does not use up the
    victim's signature. Unsigned (the no-secret path), the copy sent to the other decode server
    is refused by P with 409 and nothing moves to it. The victim is served; a replay is 403."""
    c = trio
    p, (d1, d2) = c.prefills[0], c.decodes
    room = 7_000_001
    d1_id = _server_id(d1.url) if c.secret else None
    victim = _body(c, room, VICTIM, d1_id)
    with httpx.Client(timeout=120, headers=c.headers) as http:
        answers: dict[str, httpx.Response] = {}
        victim_d = threading.Thread(target=lambda: answers.setdefault(
            "d1", http.post(d1.url + "/generate", json=victim)))
        victim_d.start()  # D1 reserves pages and claims the room at P (P has not got it yet)
        time.sleep(1.5)
        p_bytes = _metric(c, p.url, BYTES)
        if c.secret:
            assert httpx.post(d2.url + "/generate", json=victim,  # no API key: 401 first
                              timeout=30).status_code == 401
            copy = {**_body(c, room, OTHER), "bootstrap_sig": victim["bootstrap_sig"]}
            for d, why in ((d2, "another decode server"), (d1, "does not sign this route and "
                                                            "request")):
                r = http.post(d.url + "/generate", json=copy)
                assert r.status_code == 403 and why in r.text, (r.status_code, r.text)
            r = http.post(d2.url + "/generate", json=victim)  # the same prompt, elsewhere
            assert r.status_code == 403 and "another decode server" in r.text, r.text
        r = http.post(d2.url + "/generate", json=_body(c, room, OTHER))  # unsigned: P refuses
        assert r.status_code == 409, (r.status_code, r.text)
        assert "bound to another decode server" in r.text, r.text
        assert r.json()["error"]["code"] == "room_claimed", r.text  # #46: the reason's code
        assert _metric(c, p.url, BYTES) == p_bytes and _metric(c, d2.url, BYTES) == 0
        assert _metric(c, p.url, "pdserve_scheduler_kv_room_claims_refused_total") >= 1
        victim_p = http.post(p.url + "/generate", json=victim)
        victim_d.join(120)
        assert victim_p.status_code == 200, victim_p.text
        assert answers["d1"].status_code == 200, answers["d1"].text
        assert _metric(c, d2.url, BYTES) == 0
        if c.secret:  # a signature is good for one request per server: a replay is refused
            p_bytes = _metric(c, p.url, BYTES)
            for s in (d1, p):
                r = http.post(s.url + "/generate", json=victim)
                assert r.status_code == 403 and "used already" in r.text, r.text
            assert _metric(c, p.url, BYTES) == p_bytes
    c.wait_pages_free()


def test_another_prompt_is_refused_before_any_page_leaves(trio: PDCluster) -> None:
    """The copy claims the room first (unsigned: with the secret a copy with another prompt is
    a 403 at HTTP, above): P compares decode's prompt digest with its own and fails the room on
    both sides (409, the reason) before it prefills; no byte moves."""
    c = trio
    p, d2 = c.prefills[0], c.decodes[1]
    room = 7_000_002
    p_bytes = _metric(c, p.url, BYTES)
    with httpx.Client(timeout=120, headers=c.headers) as http:
        answers: dict[str, httpx.Response] = {}
        copy = threading.Thread(target=lambda: answers.setdefault(
            "d2", http.post(d2.url + "/generate", json=_body(c, room, OTHER))))
        copy.start()
        time.sleep(1.5)  # D2's claim reaches P first
        victim_p = http.post(p.url + "/generate", json=_body(c, room, VICTIM))
        copy.join(120)
    for r in (victim_p, answers["d2"]):
        assert r.status_code == 409 and "prompt" in r.text and "digest" in r.text, r.text
        assert r.json()["error"]["code"] == "prompt_mismatch", r.text  # #46: the reason's code
    assert _metric(c, p.url, BYTES) == p_bytes and _metric(c, d2.url, BYTES) == 0
    c.wait_pages_free()
    ok = httpx.post(c.url + "/generate", json={"text": VICTIM, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}, headers=c.headers, timeout=120)
    assert ok.status_code == 200, ok.text


def test_requests_sent_to_decode_alone_hold_nothing(trio: PDCluster) -> None:
    """12 requests whose prompts would take D's whole pool, sent to D alone (never to P): none
    of D's pages is taken, a real request completes meanwhile, and each orphan gets its reason
    once D stops waiting for P's confirmation (6 claim timeouts: 6 s here). With the secret,
    half of them carry a valid signature (for this D and this request), half none."""
    c = trio
    p, d1 = c.prefills[0], c.decodes[0]
    d1_id = _server_id(d1.url) if c.secret else None
    long = "word " * 300  # 12 of them need far more than D's 2,048-token pool
    answers: list[httpx.Response] = []
    started = time.monotonic()
    with httpx.Client(timeout=120, headers=c.headers) as http:
        orphans = [threading.Thread(target=lambda i=i: answers.append(http.post(
            d1.url + "/generate", json=_body(c, 8_000_000 + i, long, d1_id if i % 2 else None))))
            for i in range(12)]
        for t in orphans:
            t.start()
        time.sleep(1.5)
        assert load_at_rest(c.load(d1)), c.load(d1)  # the orphans hold no page
        room, real = {}, _body(c, 8_100_000, VICTIM, d1_id)
        pair = threading.Thread(target=lambda: room.setdefault(
            "d", http.post(d1.url + "/generate", json=real)))
        pair.start()
        ok = http.post(p.url + "/generate", json=real)
        pair.join(120)
        assert ok.status_code == 200 and room["d"].status_code == 200, (ok.text, room)
        for t in orphans:
            t.join(60)
    assert len(answers) == 12 and time.monotonic() - started < 40
    for r in answers:
        assert r.status_code == 502 and "did not confirm this room" in r.text, r.text
        assert r.json()["error"]["code"] == "peer_failed", r.text  # #46: the reason's code
    assert _metric(c, d1.url, "pdserve_scheduler_kv_unconfirmed_rooms_total") >= 12
    c.wait_pages_free()
