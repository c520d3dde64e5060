"""One decode server per room, bound to its prompt (issue 44 item 1): real P and two D servers
on loopback, the attacker talking to them directly as an outsider with a copied route would.

The victim's route (room, and with a cluster secret a valid signature) is copied into a request
to the other decode server, carrying another prompt: P refuses to send that server anything
(the room is bound to the first decode server that claimed it, 409 `room_claimed`), and when the
copy claims first, P compares the digest of decode's whole prompt with its own before any page
leaves (409 `prompt_mismatch` on both sides). Transfer counters prove that no byte moved.

Orphan rooms (issue 44 item 7): requests sent to a decode server alone, naming the real P, hold
none of its pages (D reserves only once P confirmed it has the request) and fail within a few
seconds; another user's request completes meanwhile."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from pdcore.route_auth import route_key, sign_route
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import PDCluster

pytestmark = pytest.mark.timeout(300)
FLAGS = ("--max-total-tokens", "2048", "--page-size", "4", "--skip-server-warmup")
SECRET = "room-binding-secret"
VICTIM = "The secret code of the vault is 4711. Repeat the code:"
OTHER = "Tell me a story about a cat"


@pytest.fixture(scope="module", params=[("tcp", None), ("shm", SECRET)],
                ids=["tcp-open", "shm-secret"])
def trio(request, tiny_llama_dir: Path):
    backend, secret = request.param
    c = PDCluster(backend, decode=2, model_path=str(tiny_llama_dir), flags=FLAGS,
                  secret=secret, env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
                                      "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
                                      "PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT": "1"})
    c.start(300)
    yield c
    c.stop()


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _body(c: PDCluster, room: int, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": c.bootstrap_ports[0],
            "bootstrap_room": room}
    if c.secret:  # the attacker holds a valid (copied) signature of the victim's route
        body["bootstrap_sig"] = sign_route(route_key(c.secret), room, "127.0.0.1",
                                           c.bootstrap_ports[0])
    return body


BYTES = "pdserve_kv_transfer_bytes_total"


def test_a_copied_route_gets_nothing(trio: PDCluster) -> None:
    """The victim's decode server claims the room first; the copy sent to the other decode
    server, with another prompt, is refused with 409 and nothing moves to it; the victim is
    served."""
    c = trio
    p, (d1, d2) = c.prefills[0], c.decodes
    room = 7_000_001
    victim = _body(c, room, VICTIM)
    with httpx.Client(timeout=120) as http:
        answers: dict[str, httpx.Response] = {}
        victim_d = threading.Thread(target=lambda: answers.setdefault(
            "d1", http.post(d1.url + "/generate", json=victim)))
        victim_d.start()  # D1 reserves pages and claims the room at P (P has not got it yet)
        time.sleep(1.5)
        p_bytes = _metric(p.url, BYTES)
        r = http.post(d2.url + "/generate", json=_body(c, room, OTHER))
        assert r.status_code == 409, (r.status_code, r.text)
        assert "bound to another decode server" in r.text, r.text
        assert _metric(p.url, BYTES) == p_bytes and _metric(d2.url, BYTES) == 0
        assert _metric(p.url, "pdserve_scheduler_kv_room_claims_refused_total") >= 1
        victim_p = http.post(p.url + "/generate", json=victim)
        victim_d.join(120)
        assert victim_p.status_code == 200, victim_p.text
        assert answers["d1"].status_code == 200, answers["d1"].text
        assert _metric(d2.url, BYTES) == 0
        if c.secret:  # a signature is good for one request per server: a replay is refused
            p_bytes = _metric(p.url, BYTES)
            for s in (d1, p):
                r = http.post(s.url + "/generate", json=victim)
                assert r.status_code == 403 and "used already" in r.text, r.text
            assert _metric(p.url, BYTES) == p_bytes
    c.wait_pages_free()


def test_another_prompt_is_refused_before_any_page_leaves(trio: PDCluster) -> None:
    """The copy claims the room first: P compares decode's prompt digest with its own and fails
    the room on both sides (409, the reason) before it prefills; no byte moves."""
    c = trio
    p, d2 = c.prefills[0], c.decodes[1]
    room = 7_000_002
    p_bytes = _metric(p.url, BYTES)
    with httpx.Client(timeout=120) as http:
        answers: dict[str, httpx.Response] = {}
        copy = threading.Thread(target=lambda: answers.setdefault(
            "d2", http.post(d2.url + "/generate", json=_body(c, room, OTHER))))
        copy.start()
        time.sleep(1.5)  # D2's claim reaches P first
        victim_p = http.post(p.url + "/generate", json=_body(c, room, VICTIM))
        copy.join(120)
    for r in (victim_p, answers["d2"]):
        assert r.status_code == 409 and "prompt" in r.text and "digest" in r.text, r.text
    assert _metric(p.url, BYTES) == p_bytes and _metric(d2.url, BYTES) == 0
    c.wait_pages_free()
    ok = httpx.post(c.url + "/generate", json={"text": VICTIM, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}, timeout=120)
    assert ok.status_code == 200, ok.text


def test_requests_sent_to_decode_alone_hold_nothing(trio: PDCluster) -> None:
    """12 requests whose prompts would take D's whole pool, sent to D alone (never to P): none
    of D's pages is taken, a real request completes meanwhile, and each orphan gets its reason
    once D stops waiting for P's confirmation (6 claim timeouts: 6 s here)."""
    c = trio
    p, d1 = c.prefills[0], c.decodes[0]
    long = "word " * 300  # 12 of them need far more than D's 2,048-token pool
    answers: list[httpx.Response] = []
    started = time.monotonic()
    with httpx.Client(timeout=120) as http:
        orphans = [threading.Thread(target=lambda i=i: answers.append(http.post(
            d1.url + "/generate", json=_body(c, 8_000_000 + i, long)))) for i in range(12)]
        for t in orphans:
            t.start()
        time.sleep(1.5)
        assert load_at_rest(c.load(d1)), c.load(d1)  # the orphans hold no page
        room, real = {}, _body(c, 8_100_000, VICTIM)
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
    assert _metric(d1.url, "pdserve_scheduler_kv_unconfirmed_rooms_total") >= 12
    c.wait_pages_free()
