"""`--dp-size 2`: two replicas behind one server (real `pdserve serve`, tiny random Llama).

- the balancer (pdcore.runtime.dp.balance) picks per method; stats merge across replicas;
- greedy on either replica equals transformers and `--dp-size 1`;
- round_robin alternates replicas, shortest_queue avoids the busy one, `data_parallel_rank`
  pins a request (400 when out of range); /get_load has one entry per replica with `dp_rank`;
- a client leaving a request on one replica leaves the other replica's request intact;
- /flush_cache reaches every replica; every pool is at rest at the end;
- killing one replica's scheduler ends the server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdserve_testing import ServerProcess

from pdcore.messages.stats import Kind, StatsReport
from pdcore.runtime.dp.balance import DPBalancer
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import spawned_children

FLAGS = ("--max-total-tokens", "16384", "--page-size", "4")
LONG = 8000  # new tokens of a request that stays in flight while a test looks around
PROMPT = [1, 17, 300, 42, 99, 7, 123, 5, 250, 61]
NEW = 12

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]  # heavy: DP/TP process trees


# ---- balancer units -------------------------------------------------------------------------
def test_round_robin_cycles() -> None:
    b = DPBalancer(3, "round_robin")
    picks = []
    for _ in range(6):
        r = b.pick()
        b.start(r, 10)
        picks.append(r)
    assert picks == [0, 1, 2, 0, 1, 2]


def test_shortest_queue_takes_the_replica_with_fewest_requests() -> None:
    b = DPBalancer(2, "shortest_queue")
    b.start(0, 1)
    b.start(0, 1)  # two pinned to replica 0
    assert b.pick() == 1
    b.start(1, 1)
    assert b.pick() == 1  # 2 vs 1
    b.finish(0, 1)
    b.finish(0, 1)
    assert b.reqs == [0, 1] and b.pick() == 0


def test_minimum_tokens_weighs_tokens_not_requests() -> None:
    b = DPBalancer(2, "minimum_tokens")
    b.start(0, 1000)
    b.start(1, 10)
    b.start(1, 10)
    assert b.pick() == 1  # two small requests weigh less than one large
    b.finish(0, 1000)
    assert b.pick() == 0


def test_ties_alternate_and_bad_method_is_refused() -> None:
    for method in ("shortest_queue", "minimum_tokens"):
        b = DPBalancer(2, method)
        assert [b.pick() for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError):
        DPBalancer(2, "random")


def test_merge_stats_adds_counts_and_keeps_per_replica_gauges() -> None:
    def report(running: int, prompt: int, seconds: float) -> StatsReport:
        r = StatsReport().add(Kind.LOAD, {"num_running_reqs": running})
        r.add(Kind.INFO, {"page_size": 4, "native_kernels": 1, "radix_cache_enabled": True})
        r.add(Kind.TOTAL, {"prompt_tokens_total": prompt, "cache_hit_tokens_total": 5,
                           "forward_decode_seconds_total": seconds})
        return r.add(Kind.INFO, {"cache_hit_rate": 5 / prompt})

    m = StatsReport.merge([report(1, 10, 0.5), report(2, 30, 0.25)]).as_dict()
    assert m["num_running_reqs"] == 3 and m["page_size"] == 4
    assert m["prompt_tokens_total"] == 40 and m["cache_hit_rate"] == 0.25
    assert m["forward_decode_seconds_total"] == 0.75  # float totals add up too
    assert m["native_kernels"] == 1  # a property, not a count: replica 0's
    assert m["dp0_num_running_reqs"] == 1 and m["dp1_num_running_reqs"] == 2
    assert m["radix_cache_enabled"] is True


def test_replicas_on_a_host_share_its_kv_budget() -> None:
    import torch

    from pdcore.config import ServerArgs
    from pdcore.engine.build import kv_pool_tokens
    from pdcore.interfaces.platform import MemoryInfo

    class Host:
        def memory_info(self, device: torch.device) -> MemoryInfo:
            return MemoryInfo(free_bytes=16 << 30, total_bytes=16 << 30)

    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    weights = 1024 * 1025 * 4
    for dp in (1, 2, 4):
        args = ServerArgs(max_running_requests=1000, dp_size=dp)
        got = kv_pool_tokens(args, Host(), torch.device("cpu"), model, 4096, 8192)
        assert got == (int((16 << 30) * 0.1 / dp) - weights) // 4096


# ---- a real server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp2(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS, "--dp-size", "2")
    try:
        yield server.wait_healthy(240)
    finally:
        server.stop()


def generate(server: ServerProcess, ids: list[int], new: int = NEW, **extra: Any
             ) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0,
                                                  "ignore_eos": True}, **extra}
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def finished(server: ServerProcess) -> list[int]:
    return [d["finished_total"] for d in server.loads()]


def wait_at_rest(server: ServerProcess, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        now = server.loads()
        if all(load_at_rest(d) and d["num_reqs"] == 0 for d in now):
            return now
        assert time.monotonic() < deadline, f"pools not at rest: {now}"
        time.sleep(0.05)


def test_get_load_has_one_entry_per_dp_rank(dp2: ServerProcess) -> None:
    now = dp2.loads()
    assert [d["dp_rank"] for d in now] == [0, 1]
    assert all(d["num_pages_total"] > 0 for d in now)
    info = httpx.get(dp2.url + "/get_server_info", timeout=10).json()
    assert info["dp_size"] == 2 and info["load_balance_method"] == "round_robin"


def test_greedy_on_each_replica_matches_transformers(dp2: ServerProcess,
                                                     tiny_llama_dir: Path) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    ref = hf_greedy(model, PROMPT, NEW)
    for rank in (0, 1):
        before = finished(dp2)
        r = generate(dp2, PROMPT, data_parallel_rank=rank)
        assert r.status_code == 200, r.text
        assert check_greedy(r.json()["output_ids"], ref).startswith(("identical", "near-tie"))
        after = finished(dp2)
        assert after[rank] == before[rank] + 1 and after[1 - rank] == before[1 - rank], (
            f"data_parallel_rank {rank} ran elsewhere: {before} -> {after}")


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router not installed")
def test_sglang_router_dp_aware_reaches_each_replica(dp2: ServerProcess,
                                                    tiny_llama_dir: Path) -> None:
    """sglang-router in its regular (not PD) mode with --dp-aware: it reads dp_size from the
    server, routes to URL@rank and names the rank; each replica serves transformers' tokens."""
    import transformers

    from pdcore.testing.processes import free_port

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    ref = hf_greedy(model, PROMPT, NEW)
    router = ServerProcess("--worker-urls", dp2.url, "--dp-aware", "--policy", "round_robin",
                           "--prometheus-host", "127.0.0.1", "--prometheus-port",
                           str(free_port()), command=("-m", "sglang_router.launch_router"))
    try:
        router.wait_healthy(120)
        before = finished(dp2)
        for _ in range(4):
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW,
                                                             "temperature": 0.0,
                                                             "ignore_eos": True}}
            r = httpx.post(router.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert check_greedy(r.json()["output_ids"], ref).startswith(("identical",
                                                                         "near-tie"))
        after = finished(dp2)
        assert [a - b for a, b in zip(after, before)] == [2, 2], (before, after)
    finally:
        router.stop()
    wait_at_rest(dp2)


def test_out_of_range_data_parallel_rank_is_400(dp2: ServerProcess) -> None:
    for bad in (2, -1):
        r = generate(dp2, PROMPT, data_parallel_rank=bad)
        assert r.status_code == 400, r.text
        assert "data_parallel_rank" in r.text
    assert httpx.get(dp2.url + "/health", timeout=10).status_code == 200


def test_round_robin_alternates_replicas(dp2: ServerProcess) -> None:
    before = finished(dp2)
    for _ in range(4):
        assert generate(dp2, PROMPT, new=2).status_code == 200
    after = finished(dp2)
    assert [a - b for a, b in zip(after, before)] == [2, 2]


def test_leaving_a_request_on_one_replica_keeps_the_other(dp2: ServerProcess) -> None:
    def body(rank: int, new: int) -> dict[str, Any]:
        return {"input_ids": PROMPT, "stream": True, "data_parallel_rank": rank,
                "sampling_params": {"max_new_tokens": new, "temperature": 0.0,
                                    "ignore_eos": True}}

    aborted_before = [d["aborted_total"] for d in dp2.loads()]
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", dp2.url + "/generate", json=body(0, 1000)) as keep:
        assert keep.status_code == 200
        kept = keep.iter_lines()
        first = [next(kept) for _ in range(2)]
        with client.stream("POST", dp2.url + "/generate",
                           json=body(1, LONG)) as drop:
            assert drop.status_code == 200
            dropped = drop.iter_lines()
            for _ in range(2):
                next(dropped)
        # the client left replica 1's request while replica 0's was running; it goes on (its
        # stream ends with all 1000 tokens below, and replica 0 counts no abort; a count of
        # its running requests here raced a tiny model that may already have finished)
        rest = [x for x in kept if x]
    events = [json.loads(x[len("data: "):]) for x in first + rest
              if x.startswith("data: {")]
    assert rest[-1] == "data: [DONE]"
    final = events[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length", final
    assert len(final["output_ids"]) == 1000
    now = wait_at_rest(dp2)
    assert now[1]["aborted_total"] == aborted_before[1] + 1
    assert now[0]["aborted_total"] == aborted_before[0]


def test_flush_cache_reaches_every_replica_and_pools_rest(dp2: ServerProcess) -> None:
    wait_at_rest(dp2)
    r = httpx.post(dp2.url + "/flush_cache", timeout=10, headers=dp2.admin_headers)
    assert r.status_code == 200 and r.json()["flushed"] is True, r.text
    assert len(r.json()["dp_ranks"]) == 2
    for d in dp2.loads():
        assert d["num_pages_free"] == d["num_pages_total"], d
    metrics = httpx.get(dp2.url + "/metrics", timeout=10).text
    assert "pdserve_scheduler_dp1_num_pages_free" in metrics


def test_dp1_gives_the_same_greedy_tokens(dp2: ServerProcess, tiny_llama_dir: Path) -> None:
    ours = generate(dp2, PROMPT, data_parallel_rank=1).json()["output_ids"]
    one = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS)
    try:
        one.wait_healthy(240)
        assert generate(one, PROMPT).json()["output_ids"] == ours
        assert len(spawned_children(one.proc.pid)) == 1  # --dp-size 1: one scheduler, as before
    finally:
        one.stop()


def test_shortest_queue_avoids_the_busy_replica_and_a_dead_replica_ends_the_server(
        tiny_llama_dir: Path) -> None:
    server = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS, "--dp-size", "2",
                           "--load-balance-method", "shortest_queue")
    try:
        server.wait_healthy(240)
        assert len(spawned_children(server.proc.pid)) == 2
        long = {"input_ids": PROMPT, "stream": True, "data_parallel_rank": 1,
                "sampling_params": {"max_new_tokens": LONG, "temperature": 0.0,
                                    "ignore_eos": True}}
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", server.url + "/generate", json=long) as busy:
            lines = busy.iter_lines()  # kept: a dropped iterator closes the stream (an abort)
            assert next(lines).startswith("data: {")
            before = finished(server)
            for _ in range(3):  # round_robin would put one of these on replica 1
                assert generate(server, PROMPT, new=2).status_code == 200
            after = finished(server)
            assert server.loads()[1]["num_reqs"] == 1  # the long one was in flight all along
            assert [a - b for a, b in zip(after, before)] == [3, 0]
        wait_at_rest(server)
        victim = spawned_children(server.proc.pid)[1]
        os.kill(victim, signal.SIGKILL)
        assert server.proc.wait(15) == 1, server.log()[-3000:]
    finally:
        server.stop()


def test_dp2_with_tp2_replicas_match_transformers(tiny_llama_dir: Path) -> None:
    """Each replica is its own TP group (its own rendezvous); 2 x 2 rank processes."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    ref = hf_greedy(model, PROMPT, NEW)
    server = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS, "--dp-size", "2",
                           "--tp-size", "2")
    try:
        server.wait_healthy(240)
        for rank in (0, 1):
            r = generate(server, PROMPT, data_parallel_rank=rank)
            assert r.status_code == 200, r.text
            assert check_greedy(r.json()["output_ids"], ref).startswith(("identical", "near-tie"))
        assert len(server.loads()) == 2
        wait_at_rest(server)
    finally:
        server.stop()
