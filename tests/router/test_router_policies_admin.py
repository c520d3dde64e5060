"""Policies' distribution through a real router, runtime worker management, info routes."""

from __future__ import annotations

import time

from pdserve_testing import ADMIN_HEADERS, TEST_ADMIN_KEY


def _served_by(worker_list, before):
    """Names of the workers that got a request since `before` (list of per-worker counts);
    waits for one to arrive (the router does not wait for prefill before answering)."""
    deadline = time.monotonic() + 5
    while sum(len(w.received) for w in worker_list) <= sum(before):
        assert time.monotonic() < deadline, "no worker received the request"
        time.sleep(0.01)
    return [w.name for w, n in zip(worker_list, before) if len(w.received) > n]


def test_round_robin_alternates_prefill_and_decode_separately(fake_worker, router):
    ps = [fake_worker("prefill", name="pA"), fake_worker("prefill", name="pB")]
    ds = [fake_worker("decode", name="dA"), fake_worker("decode", name="dB"),
          fake_worker("decode", name="dC")]
    r = router([(w, None) for w in ps], ds, policy="round_robin")
    p_seq, d_seq = [], []
    for _ in range(6):
        pb, db = [len(w.received) for w in ps], [len(w.received) for w in ds]
        assert r.client.post("/generate", json={"text": "x"}).status_code == 200
        p_seq += _served_by(ps, pb)
        d_seq += _served_by(ds, db)
    assert p_seq == ["pA", "pB"] * 3
    assert d_seq == ["dA", "dB", "dC"] * 2


def test_power_of_two_prefers_lower_polled_load(fake_worker, router):
    p = fake_worker("prefill")
    busy = fake_worker("decode", name="busy", load_tokens=[600, 400])  # DP ranks summed: 1000
    idle = fake_worker("decode", name="idle", load_tokens=[5, 5])
    r = router([(p, None)], [busy, idle], policy="power_of_two", load_check_interval_secs=0.1)
    deadline = time.monotonic() + 5
    while r.worker_state(busy.url)["load"] != 1000 or r.worker_state(idle.url)["load"] != 10:
        assert time.monotonic() < deadline, r.client.get("/workers").text
        time.sleep(0.05)
    for _ in range(6):
        assert r.client.post("/generate", json={"text": "x"}).status_code == 200
    assert len(idle.received) == 6 and busy.received == []
    loads = {w["url"]: w["num_tokens"] for w in r.client.get("/get_loads").json()["workers"]}
    assert loads[busy.url] == 1000 and loads[idle.url] == 10


def test_cache_aware_keeps_prefix_affinity(fake_worker, router):
    ps = [fake_worker("prefill", name="pA"), fake_worker("prefill", name="pB")]
    ds = [fake_worker("decode", name="dA"), fake_worker("decode", name="dB")]
    r = router([(w, None) for w in ps], ds, policy="cache_aware")
    doc_a, doc_b = "Alpha document. " * 20, "Bravo manual! " * 20
    chosen: dict[str, set[str]] = {"a": set(), "b": set()}
    for i in range(4):
        for key, doc in (("a", doc_a), ("b", doc_b)):
            before = [len(w.received) for w in ps]
            msgs = [{"role": "system", "content": doc}, {"role": "user", "content": f"q{i}"}]
            resp = r.client.post("/v1/chat/completions", json={"messages": msgs})
            assert resp.status_code == 200
            chosen[key].update(_served_by(ps, before))
    assert len(chosen["a"]) == 1 and len(chosen["b"]) == 1
    assert chosen["a"] != chosen["b"]  # a new prefix goes to the emptier cache


def test_add_and_remove_workers_at_runtime(fake_worker, router):
    p, d1 = fake_worker("prefill"), fake_worker("decode", name="d1")
    d2 = fake_worker("decode", name="d2")
    r = router([(p, None)], [d1], admin_api_key=TEST_ADMIN_KEY)
    resp = r.client.post("/workers", json={"url": d2.url, "worker_type": "decode"},
                         headers=ADMIN_HEADERS)
    assert resp.status_code == 200 and resp.json()["status"] == "added"
    listed = r.client.get("/workers").json()
    assert listed["total"] == 3 and listed["stats"] == {"prefill": 1, "decode": 2}
    for _ in range(4):
        r.client.post("/generate", json={"text": "x"})
    assert len(d2.received) == 2 and len(d1.received) == 2
    # errors say what is wrong
    dup = r.client.post("/workers", json={"url": d2.url, "worker_type": "decode"},
                        headers=ADMIN_HEADERS)
    assert dup.status_code == 409
    bad = r.client.post("/workers", json={"url": "http://127.0.0.1:1", "worker_type": "mixed"},
                        headers=ADMIN_HEADERS)
    assert bad.status_code == 400 and "worker_type" in bad.json()["error"]["message"]
    bad = r.client.post("/workers", json={"url": "not a url", "worker_type": "decode"},
                        headers=ADMIN_HEADERS)
    assert bad.status_code == 400
    assert r.client.request("DELETE", "/workers", json={"url": d2.url},
                            headers=ADMIN_HEADERS).status_code == 200
    assert r.client.delete("/workers", params={"url": d2.url},
                           headers=ADMIN_HEADERS).status_code == 404
    for _ in range(3):
        r.client.post("/generate", json={"text": "x"})
    assert len(d2.received) == 2 and len(d1.received) == 5
    # legacy endpoints, with a bootstrap port that reaches the request
    p2 = fake_worker("prefill", name="p2")
    add = r.client.post("/add_worker", params={"url": p2.url, "worker_type": "prefill",
                                               "bootstrap_port": "9100"},
                         headers=ADMIN_HEADERS)
    assert add.status_code == 200
    assert r.client.post("/remove_worker", params={"url": p.url},
                         headers=ADMIN_HEADERS).status_code == 200
    assert r.client.post("/generate", json={"text": "x"}).status_code == 200
    assert p2.wait_received(1)[-1]["bootstrap_port"] == 9100


def test_added_worker_waits_for_health(fake_worker, router):
    p, d1 = fake_worker("prefill"), fake_worker("decode")
    d2 = fake_worker("decode", health_status=503)
    r = router([(p, None)], [d1], admin_api_key=TEST_ADMIN_KEY)
    resp = r.client.post("/workers", json={"url": d2.url, "worker_type": "decode"},
                         headers=ADMIN_HEADERS)
    assert resp.status_code == 202 and resp.json()["worker"]["available"] is False
    for _ in range(2):
        r.client.post("/generate", json={"text": "x"})
    assert d2.received == []
    d2.health_status = 200
    deadline = time.monotonic() + 5
    while not r.worker_state(d2.url)["available"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(2):
        r.client.post("/generate", json={"text": "x"})
    assert len(d2.received) == 1


def test_info_and_admin_routes(fake_worker, router):
    p, d = fake_worker("prefill", name="pp"), fake_worker("decode", name="dd")
    r = router([(p, 8998)], [d], admin_api_key=TEST_ADMIN_KEY)
    info = r.client.get("/get_server_info").json()
    assert [i["worker"] for i in info["prefill"]] == ["pp"]
    assert [i["worker"] for i in info["decode"]] == ["dd"]
    assert info["router"]["pd_disaggregation"] is True
    assert r.client.get("/server_info").json()["prefill"][0]["worker"] == "pp"
    assert r.client.get("/get_model_info").json()["worker"] == "pp"  # from a prefill worker
    assert r.client.get("/model_info").status_code == 200
    models = r.client.get("/v1/models").json()  # fakes lack /v1/models: built from server info
    assert models["data"][0]["id"] == "tiny"
    flush = r.client.post("/flush_cache", headers=ADMIN_HEADERS)
    assert flush.status_code == 200 and p.flushes == 1 and d.flushes == 1
    # the fan-out carries the router's admin key (the workers' flush is an admin route)
    assert p.flush_auth == d.flush_auth == [ADMIN_HEADERS["authorization"]]
    assert r.client.get("/health_generate").status_code == 200
    d.health_status = 500
    assert r.client.get("/health_generate").status_code == 503
    d.health_status = 200
    r.client.post("/generate", json={"text": "x"})
    metrics = r.client.get("/metrics").text
    assert ('smg_router_requests_total{backend_type="pd",connection_mode="http",'
            'endpoint="generate",model="default",router_type="http",streaming="false"} 1.0'
            in metrics)
    assert 'smg_http_responses_total{error_code="",status_code="200"} 1.0' in metrics
    assert f'smg_worker_cb_state{{worker="{p.url}"}} 0.0' in metrics
    assert "smg_router_request_duration_seconds_bucket" in metrics


def test_mini_lb_forwards_without_health_checks(fake_worker, router):
    p, d = fake_worker("prefill"), fake_worker("decode")
    r = router([(p, 8998)], [d], mini_lb=True)
    resp = r.client.post("/generate", json={"text": ["a", "b"], "stream": True,
                                            "return_logprob": True})
    assert resp.status_code == 200 and "[DONE]" in resp.text
    assert p.wait_received(1)[0]["bootstrap_port"] == [8998, 8998]
    assert p.health_calls == 0 and d.health_calls == 0
