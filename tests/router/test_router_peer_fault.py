"""Whom the router blames, and what a client that gives up costs (issue 16, items 1 and 5)."""

from __future__ import annotations

import time

import httpx


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_prefill_reporting_its_decode_peer_opens_decode_circuit_only(fake_worker, router):
    """A prefill server answers 502 when its decode peer failed the pair: the prefill circuit
    stays closed and the decode worker takes the blame."""
    p = fake_worker("prefill", fail_statuses=[502, 502])
    d = fake_worker("decode", delay=0.3)
    r = router([(p, None)], [d], retry_max_retries=1, cb_failure_threshold=2,
               cb_timeout_duration_secs=30)
    for _ in range(2):
        resp = r.client.post("/generate", json={"text": "x"})
        assert resp.status_code == 502, resp.text
        err = resp.json()["error"]
        assert err["code"] == "decode_bad_gateway" and p.url in err["message"], err
    assert r.worker_state(p.url)["circuit"]["state"] == "closed"
    assert r.worker_state(d.url)["circuit"]["state"] == "open"
    metrics = r.client.get("/metrics").text
    assert 'kind="peer_fault",worker_type="decode"' in metrics or \
        'worker_type="decode",kind="peer_fault"' in metrics


def test_client_gone_before_first_byte_aborts_both_legs(fake_worker, router):
    """Neither leg has answered a byte when the client gives up: both upstream calls are
    cancelled at once (the workers see the disconnect), not when decode would have finished."""
    p = fake_worker("prefill", hang_until_disconnect=True)
    d = fake_worker("decode", hang_until_disconnect=True)
    r = router([(p, None)], [d])
    for stream in (False, True):
        before = (p.disconnects, d.disconnects)
        try:
            httpx.post(r.url + "/generate", json={"text": "x", "stream": stream}, timeout=0.5)
        except httpx.ReadTimeout:
            pass  # the client gave up; httpx closed its connection
        else:
            raise AssertionError("the hanging workers answered")
        _wait(lambda b=before: (p.disconnects, d.disconnects) == (b[0] + 1, b[1] + 1))
        _wait(lambda: r.worker_state(p.url)["in_flight"] == 0
              and r.worker_state(d.url)["in_flight"] == 0)
    # nobody was blamed for the client's choice
    assert r.worker_state(p.url)["circuit"]["state"] == "closed"
    assert r.worker_state(d.url)["circuit"]["state"] == "closed"


def test_decode_reporting_its_prefill_peer_opens_prefill_circuit_only(fake_worker, router):
    """The mirror case: a decode server answers 502 when its prefill peer failed the pair (lost,
    frozen, unreachable): the decode circuit stays closed and the prefill worker takes the
    blame, so a healthy decode is not shut out after its prefill peer comes back."""
    p = fake_worker("prefill", delay=0.3)
    d = fake_worker("decode", fail_statuses=[502, 502])
    r = router([(p, None)], [d], retry_max_retries=1, cb_failure_threshold=2,
               cb_timeout_duration_secs=30)
    for _ in range(2):
        resp = r.client.post("/generate", json={"text": "x"})
        assert resp.status_code == 502, resp.text
        err = resp.json()["error"]
        assert err["code"] == "prefill_bad_gateway" and d.url in err["message"], err
    assert r.worker_state(d.url)["circuit"]["state"] == "closed"
    assert r.worker_state(p.url)["circuit"]["state"] == "open"
