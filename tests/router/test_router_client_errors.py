"""The circuit breaker counts only the workers' faults (issue #30, part 5): what the client
caused never opens a circuit and is never retried on another worker; a half-open circuit is
closed by a good health probe. Every router here opens a circuit on one failure
(cb_failure_threshold=1), so a single miscounted answer would show as an open circuit."""

from __future__ import annotations

import time

import pytest

CLIENT = {"X-PD-Error-Origin": "client"}


def _wait(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _outcome(metrics: str, worker: str, outcome: str) -> float:
    prefix = f'smg_worker_cb_outcomes_total{{outcome="{outcome}",worker="{worker}"}} '
    return float(next(line for line in metrics.splitlines() if line.startswith(prefix))
                 .rsplit(" ", 1)[1])


@pytest.mark.parametrize("status, headers", [(504, CLIENT), (500, CLIENT), (400, {})])
def test_decode_client_error_passed_on_not_retried_not_counted(fake_worker, router, status,
                                                                headers):
    p = fake_worker("prefill", delay=0.3)  # decode's answer comes first
    d = fake_worker("decode", fail_statuses=[status], fail_headers=headers)
    r = router([(p, None)], [d], cb_failure_threshold=1, retry_initial_backoff_ms=1)
    resp = r.client.post("/generate", json={"text": "x"})
    assert resp.status_code == status and f"injected {status}" in resp.text  # as D sent it
    if headers:
        assert resp.headers["x-pd-error-origin"] == "client"
    assert len(d.received) == 1  # not retried
    for w in (p, d):
        assert r.worker_state(w.url)["circuit"]["state"] == "closed"
        assert r.worker_state(w.url)["circuit"]["total_failures"] == 0
    metrics = r.client.get("/metrics").text
    assert _outcome(metrics, d.url, "failure") == 0
    assert _outcome(metrics, d.url, "client_error") == (1 if headers else 0)


def test_prefill_client_marked_504_passed_on_not_retried_not_counted(fake_worker, router):
    p = fake_worker("prefill", fail_statuses=[504], fail_headers=CLIENT)
    d = fake_worker("decode", hang_until_disconnect=True)
    r = router([(p, None)], [d], cb_failure_threshold=1, retry_initial_backoff_ms=1)
    resp = r.client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 504 and resp.headers["x-pd-error-origin"] == "client"
    assert len(p.received) == 1
    assert r.worker_state(p.url)["circuit"]["state"] == "closed"
    assert r.worker_state(p.url)["circuit"]["total_client_errors"] == 1
    _wait(lambda: d.disconnects == 1)  # decode's leg was dropped, not left waiting


def test_failures_after_the_clients_timeout_are_not_the_workers(fake_worker, router):
    """P reports its decode peer failed (502) after the request's own timeout passed: D gave up
    on the client's timeout, so D is not blamed and nothing is retried."""
    # The timeout leaves a loaded CI box time to deliver the request to P (0.2 s once did not,
    # and P saw nothing); P's 502 still comes well after it.
    p = fake_worker("prefill", fail_statuses=[502], fail_delay=2.5)
    d = fake_worker("decode", hang_until_disconnect=True)
    r = router([(p, None)], [d], cb_failure_threshold=1, retry_initial_backoff_ms=1)
    resp = r.client.post("/generate", json={"text": "x", "timeout": 1.5})
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "request_timeout"
    assert "own timeout" in resp.json()["error"]["message"]
    assert len(p.received) == 1
    for w in (p, d):
        assert r.worker_state(w.url)["circuit"]["state"] == "closed"
        assert r.worker_state(w.url)["circuit"]["total_failures"] == 0


def test_router_deadline_follows_the_clients_timeout_and_is_not_counted(fake_worker, router):
    p = fake_worker("prefill", hang_until_disconnect=True)
    d = fake_worker("decode", hang_until_disconnect=True)
    r = router([(p, None)], [d], cb_failure_threshold=1, request_timeout_secs=60.0)
    resp = r.client.post("/generate", json={"text": "x", "timeout": 0.3})
    assert resp.status_code == 504 and "own timeout" in resp.json()["error"]["message"]
    _wait(lambda: p.disconnects == 1 and d.disconnects == 1)
    assert len(p.received) == len(d.received) == 1
    for w in (p, d):
        assert r.worker_state(w.url)["circuit"]["state"] == "closed"
        assert r.worker_state(w.url)["circuit"]["total_failures"] == 0


def test_half_open_circuit_closes_after_a_good_probe(fake_worker, router):
    p = fake_worker("prefill", fail_statuses=[500])
    d = fake_worker("decode", delay=0.2)
    r = router([(p, None)], [d], retry_max_retries=1, cb_failure_threshold=1,
               cb_timeout_duration_secs=0.3, health_check_interval_secs=0.2)
    assert r.client.post("/generate", json={"text": "x"}).status_code == 500
    assert r.worker_state(p.url)["circuit"]["state"] in ("open", "half_open")
    # no user traffic from here on: only the health probes can close it
    _wait(lambda: r.worker_state(p.url)["circuit"]["state"] == "closed")
    assert len(p.received) == 1
