"""The /metrics of a running prefill, decode and router (the folder's shared cluster on
loopback, tcp backend, a tiny random model with SmolLM2-135M's KV layout, which
bench/transfer.py measures):

- every SGLang / sglang-router name docs/metrics.md maps is exported with its type, and with
  the labels SGLang puts on it;
- no counter is exported as a gauge (no `_total` sample in a gauge family);
- a scripted run moves, per P's and D's transfer counters, exactly the bytes bench/transfer.py
  reports (and moves) for the same prompts, and the request counters count what was asked;
- failed rooms are counted by phase and reason on the side that failed, and live rooms per
  state are visible while they wait.
"""

from __future__ import annotations

import importlib.util
import random
import re
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcore.testing.processes import PDCluster, free_port, trust_prefill

from .conftest import OBS_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENS = [1, 16, 17, 100, 333]  # a page and a token past it, several pages
NEW = 2
SCHED_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank"}
Families = dict[str, Any]


def _bench(name: str) -> ModuleType:
    """bench/<name>.py as a module (bench/ is scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(REPO / "bench"))  # transfer.py imports transfer_harness
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def documented() -> dict[str, str]:
    """SGLang and sglang-router names -> type, from the tables of docs/metrics.md."""
    rows = re.findall(r"^\| `((?:sglang:|smg_)[a-z_:]+)` \| (counter|gauge|histogram) \|",
                      (REPO / "docs" / "metrics.md").read_text(), re.MULTILINE)
    return dict(rows)


def scrape(url: str) -> Families:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def family_name(name: str, kind: str) -> str:
    return name.removesuffix("_total") if kind == "counter" else name


def value(fams: Families, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for f in fams.values() for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def generate(url: str, ids: list[int], **extra: Any) -> httpx.Response:
    return httpx.post(url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0,
                                              "ignore_eos": True}, **extra}, timeout=120)


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    return _bench("transfer_harness")


@pytest.fixture
def cluster(obs_cluster: PDCluster, harness: ModuleType) -> PDCluster:
    """The folder's shared 1P1D cluster (conftest.py): its model has bench's KV layout."""
    for server in obs_cluster.prefills + obs_cluster.decodes:
        assert obs_cluster.load(server)["page_size"] == harness.MODEL["page_size"]
    return obs_cluster


def test_every_mapped_name_with_its_type(cluster: PDCluster) -> None:
    names = documented()
    assert len([n for n in names if n.startswith("sglang:")]) >= 20
    assert len([n for n in names if n.startswith("smg_")]) >= 15
    ids = [random.Random(1).randrange(3, 40000) for _ in range(40)]
    assert generate(cluster.url, ids).status_code == 200
    assert generate(cluster.url, ids[::-1], stream=True).status_code == 200
    for role, server in (("prefill", cluster.prefills[0]), ("decode", cluster.decodes[0])):
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        fams = scrape(server.url)
        for name, kind in names.items():
            if not name.startswith("sglang:"):
                continue
            fam = fams.get(family_name(name, kind))
            assert fam is not None, f"{role}: {name} missing from /metrics"
            assert fam.type == kind, f"{role}: {name} is a {fam.type}, SGLang's is a {kind}"
            assert fam.samples, f"{role}: {name} has no sample"
            for s in fam.samples:
                assert s.labels["model_name"] == model, (role, name, s.labels)
                if set(s.labels) - {"le"} != {"model_name"}:  # a scheduler series
                    assert SCHED_LABELS <= set(s.labels), (role, name, s.labels)
                    assert s.labels["engine_type"] == role, (role, name, s.labels)
        assert value(fams, "sglang:time_to_first_token_seconds_count") >= 2
        assert value(fams, "sglang:e2e_request_latency_seconds_count") >= 2
    fams = scrape(cluster.url)
    for name, kind in names.items():
        if name.startswith("smg_"):
            fam = fams.get(family_name(name, kind))
            assert fam is not None, f"router: {name} missing from /metrics"
            assert fam.type == kind, f"router: {name} is a {fam.type}, sglang-router's is a {kind}"
    assert value(fams, "smg_router_requests_total", endpoint="generate", streaming="true") >= 1
    assert value(fams, "smg_worker_health") == 2  # both workers, healthy


def test_no_counter_is_a_gauge(cluster: PDCluster) -> None:
    for server in (cluster.prefills[0], cluster.decodes[0], cluster.router):
        assert server is not None
        fams = scrape(server.url)
        assert len(fams) > 10
        for fam in fams.values():
            for s in fam.samples:
                if fam.type == "gauge":
                    assert not s.name.endswith("_total"), f"{s.name} is a gauge ({server.url})"
                elif fam.type == "counter":
                    assert s.name.endswith("_total"), (s.name, server.url)


def test_transfer_bytes_agree_with_bench(cluster: PDCluster, harness: ModuleType) -> None:
    p, d = cluster.prefills[0].url, cluster.decodes[0].url
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in PROMPT_LENS]
    # A window in which a room failed is measured again (at most 3 windows), as test_pd_n does:
    # on a loaded machine D's claim can reach P after P's claim timeout, P fails the room, the
    # router retries, and the transfer counters rightly count the retry. Every answer is checked
    # in every window; the exact counts below hold for a clean window.
    for _ in range(3):
        before = {u: scrape(u) for u in (p, d, cluster.url)}
        for ids in prompts:
            r = generate(cluster.url, ids)
            assert r.status_code == 200, r.text
            assert len(r.json()["output_ids"]) == NEW
        after = {u: scrape(u) for u in (p, d, cluster.url)}
        if not any(value(after[u], "pdserve_kv_failures_total")
                   - value(before[u], "pdserve_kv_failures_total") for u in (p, d)):
            break
    else:
        raise AssertionError("a room failed in each of 3 windows")

    def delta(url: str, name: str, **labels: str) -> float:
        return value(after[url], name, **labels) - value(before[url], name, **labels)

    moved = {}
    for url in (p, d):
        moved[url] = delta(url, "pdserve_kv_transfer_bytes_total", backend="tcp")
        assert delta(url, "pdserve_kv_transfers_total", backend="tcp") == len(prompts)
        for h in ("pdserve_kv_transfer_latency_seconds", "pdserve_kv_transfer_speed_gb_s",
                  "pdserve_kv_bootstrap_seconds"):
            assert delta(url, h + "_count") == len(prompts), (url, h)
        # SGLang's histograms of the same rooms, in its units
        for h in ("sglang:kv_transfer_latency_ms", "sglang:kv_transfer_speed_gb_s",
                  "sglang:kv_transfer_bootstrap_ms", "sglang:kv_transfer_total_mb"):
            assert delta(url, h + "_count") == len(prompts), (url, h)
        assert delta(url, "sglang:kv_transfer_total_mb_sum") == pytest.approx(moved[url] / 1e6)
        assert delta(url, "sglang:kv_transfer_latency_ms_sum") == pytest.approx(
            1e3 * delta(url, "pdserve_kv_transfer_latency_seconds_sum"))
    assert delta(p, "pdserve_scheduler_kv_bytes_total") == moved[p]  # the manager's own count
    # what was asked is what the request counters count (D serves the answers)
    assert delta(d, "sglang:num_requests_total") == len(prompts)
    assert delta(d, "sglang:prompt_tokens_total") == sum(PROMPT_LENS)
    assert delta(d, "sglang:generation_tokens_total") == NEW * len(prompts)
    assert delta(cluster.url, "smg_router_requests_total", endpoint="generate") == len(prompts)

    # bench/transfer.py on the same prompts: its tcp case in this process, one transfer per
    # prompt (pages as the servers allocate them for that many tokens), bytes checked on arrival
    transfer = _bench("transfer")
    loads = harness.workloads(64, PROMPT_LENS, seed=0)
    case = transfer.bench_tcp(harness.Env(src=None, pool_pages=64, baseline_bytes=0))
    try:
        results = transfer.measure({"tcp": case}, loads, reps=1, burst=1)
        planned = sum(case.batch(w).nbytes for w in loads)
    finally:
        case.close()
    bench_bytes = sum(r["bytes"] for r in results.values())
    print(f"\nKV bytes for prompts {PROMPT_LENS}: bench {bench_bytes}, P {moved[p]:.0f}, "
          f"D {moved[d]:.0f}")
    assert planned == bench_bytes
    assert moved[p] == moved[d] == bench_bytes


def test_failures_by_phase_and_reason(cluster: PDCluster) -> None:
    """P waits for a decode that never comes (claim timeout); D waits, holding no page, for a
    prefill that never gets the request to confirm its claim (claim timeout, bootstrap phase);
    D cannot reach a bootstrap server (unreachable)."""
    p, d = cluster.prefills[0].url, cluster.decodes[0].url
    before = {u: scrape(u) for u in (p, d)}
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_ports[0]}
    ids = [random.Random(3).randrange(3, 40000) for _ in range(20)]
    results: dict[str, httpx.Response] = {}
    nowhere = free_port()
    trust_prefill(d, nowhere)  # a trusted address where nothing listens (a prefill that is down)
    calls = {"p_alone": (p, {**boot, "bootstrap_room": 7_000_001}),
             "d_alone": (d, {**boot, "bootstrap_room": 7_000_002}),
             "d_nowhere": (d, {"bootstrap_host": "127.0.0.1", "bootstrap_port": nowhere,
                               "bootstrap_room": 7_000_003})}

    def post(name: str, url: str, extra: dict[str, Any]) -> None:
        results[name] = generate(url, ids, **extra)

    threads = [threading.Thread(target=post, args=(n, *a)) for n, a in calls.items()]
    for t in threads:
        t.start()
    seen = {"p": False, "d": False}  # the waiting rooms, in their states, while they wait
    deadline = time.monotonic() + OBS_TIMEOUT_S + 30
    while not all(seen.values()) and any(t.is_alive() for t in threads):
        seen["p"] = seen["p"] or value(scrape(p), "pdserve_kv_rooms", state="Bootstrapping") == 1
        seen["d"] = seen["d"] or value(scrape(d), "pdserve_kv_rooms", state="Bootstrapping") >= 1
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for t in threads:
        t.join(OBS_TIMEOUT_S + 60)
    assert set(results) == set(calls), "a request hung"
    for name, r in results.items():
        assert r.status_code >= 500, (name, r.status_code, r.text)
    assert seen == {"p": True, "d": True}
    after = {u: scrape(u) for u in (p, d)}

    def delta(url: str, name: str, **labels: str) -> float:
        return value(after[url], name, **labels) - value(before[url], name, **labels)

    fails = "pdserve_kv_failures_total"
    assert delta(p, fails, phase="bootstrap", reason="timeout") == 1
    assert delta(p, "sglang:num_bootstrap_failed_reqs_total") == 1
    assert delta(p, "sglang:num_transfer_failed_reqs_total") == 0
    assert delta(d, fails, phase="bootstrap", reason="timeout") == 1
    assert delta(d, fails, phase="bootstrap", reason="peer_unreachable") == 1
    assert delta(d, "sglang:num_bootstrap_failed_reqs_total") == 2
    assert delta(d, "sglang:num_transfer_failed_reqs_total") == 0
    cluster.wait_pages_free()
    for url in (p, d):
        assert value(scrape(url), "pdserve_kv_rooms") == 0


def test_transfer_stats_rooms_phases_and_dp_merge() -> None:
    """Without servers: a fake (warm-up) room is not measured, a room failing before its peer is
    ready counts as a bootstrap failure and after as a transfer failure, and a DP server's
    replicas add up (StatsReport.merge with pdcore.runtime.stats.merge_transfer_stats)."""
    from pdcore.disagg.states import KVPoll, RoomStates
    from pdcore.disagg.transfer_stats import TransferStats
    from pdcore.messages.stats import StatsReport
    from pdcore.runtime.stats import merge_transfer_stats

    snaps = []
    for rank in range(2):
        x = TransferStats("tcp")
        states = RoomStates(x.on_state)
        states.create(1, KVPoll.WaitingForInput)  # fake room: starts past bootstrap
        states.advance(1, KVPoll.Success)
        states.create(2)
        for s in (KVPoll.WaitingForInput, KVPoll.Transferring):
            states.advance(2, s)
        x.add_bytes(2, 1000 * (rank + 1))
        states.advance(2, KVPoll.Success)
        states.create(3)
        x.failed(3, "", "bootstrap timeout: decode sent no destination pages")
        states.create(4)
        states.advance(4, KVPoll.WaitingForInput)
        x.failed(4, "prefill_fault", "prefill rank 0 failed: boom")
        snap = x.snapshot()
        assert snap["totals"] == {"bytes": 1000 * (rank + 1), "transfers": 1}
        assert sum(snap["hist"]["latency_seconds"]["counts"]) == 1
        assert sum(snap["hist"]["bootstrap_seconds"]["counts"]) == 2  # rooms 2 and 4
        assert sorted(snap["failures"]) == [["bootstrap", "timeout", 1],
                                            ["transfer", "peer_failed", 1]]
        snaps.append(StatsReport({"num_running_reqs": rank}, kv_transfer={**snap,
                                                                           "rooms": {"x": 1}}))
    merged = StatsReport.merge(snaps, merge_transfer_stats).as_dict()["kv_transfer"]
    assert merged["totals"] == {"bytes": 3000, "transfers": 2} and merged["rooms"] == {"x": 2}
    assert sum(merged["hist"]["latency_seconds"]["counts"]) == 2
    assert sorted(merged["failures"]) == [["bootstrap", "timeout", 2],
                                          ["transfer", "peer_failed", 2]]
    assert merged["last"]["total_mb"] == 2000 / 1e6
