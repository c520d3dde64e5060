"""A worker that goes down leaves rotation within seconds of a failed request (not after
health_failure_threshold full intervals), and is back in rotation, its open circuit
half-opened, within one health interval of answering again. Default 60 s interval."""

from __future__ import annotations

import time


def _wait(predicate, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_down_worker_leaves_and_rejoins_rotation(fake_worker, router):
    p = fake_worker("prefill")
    d1, d2 = fake_worker("decode"), fake_worker("decode")
    r = router([(p, None)], [d1, d2], retry_max_retries=1, cb_failure_threshold=1,
               cb_timeout_duration_secs=600, health_check_interval_secs=60)
    d2.health_status = 503  # d2 "dies": its answers fail, so do its health checks
    d2.fail_statuses = [500] * 1000
    for _ in range(4):
        r.client.post("/generate", json={"text": "x"})
    out_s = _wait(lambda: not r.worker_state(d2.url)["healthy"])
    assert out_s < 5, out_s  # a few fast probes, not 3 x 60 s
    assert r.worker_state(d2.url)["circuit"]["state"] == "open"
    before = len(d2.received)
    for _ in range(4):
        assert r.client.post("/generate", json={"text": "x"}).status_code == 200
    assert len(d2.received) == before  # out of rotation
    d2.health_status, d2.fail_statuses = 200, []  # restarted
    back_s = _wait(lambda: r.worker_state(d2.url)["available"])
    assert back_s < 60, back_s  # within one health interval (in practice about a second)
    assert r.worker_state(d2.url)["circuit"]["state"] == "half_open"
    for _ in range(4):
        assert r.client.post("/generate", json={"text": "x"}).status_code == 200
    assert len(d2.received) > before  # round robin uses it again
    print(f"out of rotation after {out_s:.2f}s, back after {back_s:.2f}s")


def test_failing_but_healthy_worker_keeps_its_open_circuit(fake_worker, router):
    """Health OK alone does not close a circuit: only a worker that was down gets its retry."""
    p = fake_worker("prefill", fail_statuses=[500, 500])
    d = fake_worker("decode")
    r = router([(p, None)], [d], retry_max_retries=1, cb_failure_threshold=2,
               cb_timeout_duration_secs=600, health_check_interval_secs=0.2)
    for _ in range(2):
        r.client.post("/generate", json={"text": "x"})
    time.sleep(1.0)  # several suspect probes answer 200
    assert r.worker_state(p.url)["healthy"]
    assert r.worker_state(p.url)["circuit"]["state"] == "open"
