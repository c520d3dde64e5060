"""Per-(P, D) pair circuits (router/pairs.py; #49's P-D partition): the policy with a fake clock,
then through the router with fake workers where one decode server is cut from one prefill
server (it answers 502 `peer_failed` for routes naming that prefill's bootstrap port)."""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcore.router.circuit import CircuitState
from pdcore.router.config import RouterConfig
from pdcore.router.pairs import PairCircuits
from pdcore.router.policies import make_policy
from pdcore.router.workers import WorkerRegistry

OPEN, HALF, CLOSED = CircuitState.OPEN, CircuitState.HALF_OPEN, CircuitState.CLOSED


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cluster(n_prefill: int = 2, n_decode: int = 2) -> tuple[WorkerRegistry, list, list]:
    reg = WorkerRegistry(RouterConfig(pd_disaggregation=True))
    ps = [reg.add(f"http://127.0.0.1:{1000 + i}", "prefill", 2000 + i, healthy=True)
          for i in range(n_prefill)]
    ds = [reg.add(f"http://127.0.0.1:{3000 + i}", "decode", healthy=True)
          for i in range(n_decode)]
    return reg, ps, ds


def _fail(pairs: PairCircuits, p, d, n: int = 1) -> None:
    for _ in range(n):
        pairs.end(pairs.begin(p, d), False, "cut")


def test_pair_circuit_state_machine() -> None:
    clock = Clock()
    _, (p, _), (d, _) = _cluster()
    pairs = PairCircuits(3, 2, 10.0, clock=clock)
    _fail(pairs, p, d, 2)
    pairs.end(pairs.begin(p, d), True)  # a success resets the count (and forgets the pair)
    assert pairs.snapshot() == []
    _fail(pairs, p, d, 2)
    pairs.end(pairs.begin(p, d), None)  # neither: another kind of failure counts nothing
    assert pairs.state(p, d) is CLOSED and pairs.allows(p, d)
    _fail(pairs, p, d)
    assert pairs.state(p, d) is OPEN and not pairs.allows(p, d)
    assert pairs.counts()["open"] == 1 and pairs.total_opened == 1 and pairs.total_failures == 5
    row = pairs.snapshot()[0]
    assert (row["prefill"], row["decode"], row["state"]) == (p.key, d.key, "open")
    assert row["half_open_in_s"] == 10.0 and row["last_error"] == "cut"
    clock.now = 9.9
    assert not pairs.allows(p, d)
    clock.now = 10.0
    assert pairs.state(p, d) is HALF and pairs.allows(p, d)
    trial = pairs.begin(p, d)  # one request at a time tries a half-open pair
    assert trial.trial and not pairs.allows(p, d)
    pairs.end(trial, None)  # the trial ended without a verdict (the client left): slot free
    assert pairs.allows(p, d)
    _fail(pairs, p, d)  # a failed trial opens it again for the whole timeout
    assert pairs.state(p, d) is OPEN and pairs.total_opened == 2
    clock.now = 19.9
    assert pairs.state(p, d) is OPEN
    clock.now = 20.0
    pairs.end(pairs.begin(p, d), True)
    assert pairs.state(p, d) is HALF  # success_threshold 2
    pairs.end(pairs.begin(p, d), True)
    assert pairs.state(p, d) is CLOSED and pairs.snapshot() == []
    off = PairCircuits(1, 1, 1.0, enabled=False, clock=clock)
    _fail(off, p, d, 3)
    assert off.allows(p, d) and off.total_failures == 3 and off.total_opened == 0


def test_choose_prefers_good_pairs_and_never_refuses() -> None:
    reg, (p0, p1), (d0, d1) = _cluster()
    cfg = RouterConfig(pd_disaggregation=True)
    policies = {r: make_policy("random", cfg, random.Random(i))
                for i, r in enumerate(("prefill", "decode"))}
    pairs = PairCircuits(1, 1, 60.0)
    _fail(pairs, p0, d0)
    seen = {(p.key, d.key) for p, d in (pairs.choose(reg, policies, "x") for _ in range(60))}
    assert (p0.key, d0.key) not in seen
    assert {(p0.key, d1.key), (p1.key, d0.key), (p1.key, d1.key)} == seen
    _fail(pairs, p0, d1)  # P0 reaches no decode server: every request goes to P1
    seen = {(p.key, d.key) for p, d in (pairs.choose(reg, policies, "x") for _ in range(20))}
    assert seen == {(p1.key, d0.key), (p1.key, d1.key)}
    # a request's own failed pairs come last too (its retry takes another pairing)
    avoid = {(p1.key, d0.key)}
    assert {pairs.choose(reg, policies, "x", avoid)[1].key for _ in range(10)} == {d1.key}
    _fail(pairs, p1, d0), _fail(pairs, p1, d1)  # every pair open: still served (policy's pick)
    seen = {(p.key, d.key) for p, d in (pairs.choose(reg, policies, "x") for _ in range(60))}
    assert len(seen) == 4
    d1.healthy = p1.healthy = False
    assert pairs.choose(reg, policies, "x") == (p0, d0)
    p0.healthy = False
    assert "No available prefill" in pairs.choose(reg, policies, "x")  # type: ignore[operator]


def test_removed_workers_take_their_pairs_along() -> None:
    """Memory is bounded by the pairs of current workers that failed since they closed."""
    reg, (p0, p1), (d0, d1) = _cluster()
    pairs = PairCircuits(1, 1, 60.0)
    reg.add_remove_listener(pairs.forget)
    for p, d in ((p0, d0), (p0, d1), (p1, d0), (p1, d1)):
        _fail(pairs, p, d)
    assert len(pairs.snapshot()) == 4
    reg.remove(d0.url)
    assert {(r["prefill"], r["decode"]) for r in pairs.snapshot()} == {(p0.key, d1.key),
                                                                      (p1.key, d1.key)}
    reg.remove(p1.url)
    assert [(r["prefill"], r["decode"]) for r in pairs.snapshot()] == [(p0.key, d1.key)]


def _metrics(r) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.client.get("/metrics").text):
        for s in fam.samples:
            if s.name.startswith("pdrouter_pair"):
                key = s.name + ("" if not s.labels else f"{{{s.labels['decode']}}}")
                out[key] = s.value
    return out


def _pairs(r) -> list[dict]:
    return r.client.get("/workers").json()["pairs"]


def test_a_cut_pair_is_avoided_then_tried_again(fake_worker, router, caplog) -> None:
    """D is cut from P1: after --pair-cb-failure-threshold peer faults every request goes to
    P0 (and each failed one was retried there: the client sees 200 throughout); the pair is
    open on /workers and /metrics; after the cool-down one trial finds the link healed and
    closes it. (The pair circuits run on a fake clock: a loaded machine is no cool-down.)"""
    # a real P answers only after the KV went out (its answer is the pair's success): P1 is
    # slow, so D's report comes first and the router cancels P1's call
    p0, p1 = fake_worker("prefill"), fake_worker("prefill", delay=0.3)
    d = fake_worker("decode", cut_from_ports={7002})
    r = router([(p0, 7001), (p1, 7002)], [d], pair_cb_failure_threshold=2,
               pair_cb_timeout_duration_secs=30, cb_failure_threshold=50)
    clock = r.state.proxy.pairs.clock = Clock()
    caplog.set_level("INFO", logger="pdcore.router.pairs")
    for _ in range(12):
        resp = r.client.post("/generate", json={"text": "x"})
        assert resp.status_code == 200, resp.text
    tried_cut = [b for b in d.bodies() if b["bootstrap_port"] == 7002]
    assert len(tried_cut) == 2, [b["bootstrap_port"] for b in d.bodies()]  # the threshold
    (row,) = _pairs(r)
    assert (row["prefill"], row["decode"], row["state"]) == (p1.url, d.url, "open"), row
    assert "cannot reach prefill" in row["last_error"]
    m = _metrics(r)
    assert m["pdrouter_pair_circuits_open"] == 1 and m["pdrouter_pair_failures_total"] == 2
    assert m[f"pdrouter_pair_circuit_state{{{d.url}}}"] == 1
    assert m["pdrouter_pair_circuit_opened_total"] == 1
    assert any("pair circuit open" in rec.message for rec in caplog.records)
    # workers are not blamed into their own circuits' opening: both stay available
    assert r.worker_state(p1.url)["available"] and r.worker_state(d.url)["available"]
    clock.now = 30.0  # half-open, still cut: the trial fails (and is retried), open again
    for _ in range(3):  # round robin: P1's turn comes within two requests
        assert r.client.post("/generate", json={"text": "x"}).status_code == 200
        if _pairs(r)[0]["state"] == "open":
            break
    assert _pairs(r)[0]["state"] == "open" and _pairs(r)[0]["times_opened"] == 2
    d.cut_from_ports.clear()  # healed: the next trial closes it (once P1 answered well)
    clock.now = 60.0
    for _ in range(4):
        assert r.client.post("/generate", json={"text": "x"}).status_code == 200
    deadline = time.monotonic() + 10
    while _pairs(r) and time.monotonic() < deadline:  # P1's answer comes after decode's
        time.sleep(0.05)
    assert _pairs(r) == [] and _metrics(r)["pdrouter_pair_circuits_open"] == 0
    assert len([b for b in d.bodies() if b["bootstrap_port"] == 7002]) >= 4
    assert any("pair circuit closed" in rec.message for rec in caplog.records)


def test_a_retry_leaves_the_pair_that_failed_it(fake_worker, router) -> None:
    """cache_aware sends a known prompt back to the same prefill server: its retry after a
    peer fault goes to the other pairing anyway, below the circuit's threshold."""
    p0, p1 = fake_worker("prefill", delay=0.3), fake_worker("prefill", delay=0.3)
    d = fake_worker("decode")
    r = router([(p0, 7001), (p1, 7002)], [d], policy="cache_aware")
    assert r.client.post("/generate", json={"text": "the same prompt"}).status_code == 200
    port = d.bodies()[-1]["bootstrap_port"]  # the prefill server the prompt sticks to
    deadline = time.monotonic() + 20  # its prefill call ends in the background: a success
    while any(r.worker_state(w.url)["in_flight"] for w in (p0, p1)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    d.cut_from_ports.add(port)
    other, tried = 7001 + 7002 - port, 0
    for _ in range(3):  # a loaded test may find the other prefill less loaded: try again
        before = len(d.received)
        resp = r.client.post("/generate", json={"text": "the same prompt"})
        assert resp.status_code == 200, resp.text
        sent = [b["bootstrap_port"] for b in d.bodies()[before:]]
        assert sent in ([port, other], [other]), sent  # never the failed pair twice
        tried += sent[0] == port
        if tried:
            break
    (row,) = _pairs(r)
    assert row["state"] == "closed" and row["total_failures"] == tried == 1  # 1 of 3


@pytest.mark.parametrize("disable", ["--disable-pair-circuit-breaker", None])
def test_the_only_pairing_is_still_tried(fake_worker, router, disable) -> None:
    """1P1D with the link cut: the pair opens but is never refused (503): every request is
    tried and fails with decode's reason; --disable-pair-circuit-breaker never opens it."""
    p, d = fake_worker("prefill", delay=0.3), fake_worker("decode", cut_from_ports={7001})
    kw = {"disable_pair_circuit_breaker": True} if disable else {}
    r = router([(p, 7001)], [d], pair_cb_failure_threshold=1, retry_max_retries=2,
               cb_failure_threshold=50, **kw)
    for _ in range(2):
        resp = r.client.post("/generate", json={"text": "x"})
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "prefill_bad_gateway"
    assert len(d.received) == 4
    (row,) = _pairs(r)
    assert row["state"] == ("closed" if disable else "open") and row["total_failures"] == 4
