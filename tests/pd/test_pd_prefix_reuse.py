"""Decode-side prefix reuse (`--disaggregation-decode-enable-radix-cache`, PD protocol v2)
through real prefill + decode servers and the router on loopback (tiny random model, tcp).

A multi-turn chat (each prompt = the previous prompt + its answer + new tokens, greedy) gives
the same tokens with D-side reuse on, off, and on a unified engine; with reuse, from turn 2 on P
sends fewer KV bytes per turn (P's byte counter) and D counts the bytes it did not receive.
Parallel samples fork from a reused prefix; a forged prefix (D's cached prompt and P's prompt
differ under one room) fails the request on both sides with the digest named; a killed P and a
killed D in the middle of shared-prefix requests leave no page referenced on the survivor."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.pages import load_at_rest
from pdcore.testing.pd_faults import FAULT_ENV
from pdcore.testing.processes import PDCluster
from pdcore.testing.tiny_models import make_tiny_model

TURNS, CONVERSATIONS, NEW, FIRST_LEN, ADDED = 4, 2, 12, 40, 9
REUSE = ("--disaggregation-decode-enable-radix-cache",)
SAMPLING = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcore.engine.model.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("pd_prefix_reuse") / "m"),
                           tokenizer_from=default_model_file(), max_positions=4096)


def flags(page: int) -> tuple[str, ...]:
    return ("--max-total-tokens", "4096", "--page-size", str(page))


def conversations(model_dir: str, page: int) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """(prompts, unified greedy answers) per conversation and turn: turn k's prompt is turn
    k-1's prompt + its answer + ADDED new tokens; one extra turn for the n > 1 check."""
    rng = random.Random(page)
    eng = LLMEngine(ServerArgs(model_path=model_dir, max_total_tokens=4096, page_size=page))
    sp = SamplingParams(**SAMPLING)
    prompts: list[list[list[int]]] = []
    answers: list[list[list[int]]] = []
    try:
        for _ in range(CONVERSATIONS):
            ps, ans = [[rng.randrange(3, 1000) for _ in range(FIRST_LEN)]], []
            for _ in range(TURNS + 1):
                ans.append(eng.generate([ps[-1]], sp)[0]["output_ids"])
                ps.append(ps[-1] + ans[-1] + [rng.randrange(3, 1000) for _ in range(ADDED)])
            prompts.append(ps[:TURNS + 1])
            answers.append(ans)
    finally:
        eng.close()
    return prompts, answers


def generate(url: str, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {**SAMPLING, **extra.pop("sp", {})}, **extra}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def load(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_load", timeout=10).json()[0]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def chat(c: PDCluster, prompts: list[list[list[int]]]) -> tuple[list, list[list[int]], list]:
    """Every conversation turn by turn through the router: (answers, P's KV bytes sent per
    turn, D's reused bytes per turn)."""
    p, d = c.prefills[0].url, c.decodes[0].url
    answers: list[list[list[int]]] = [[] for _ in prompts]
    sent, reused = [[] for _ in prompts], [[] for _ in prompts]
    for turn in range(TURNS):
        for i, conv in enumerate(prompts):
            b0, r0 = load(p).get("kv_bytes", 0), load(d).get("disagg_prefix_reused_bytes_total", 0)
            answers[i].append(generate(c.url, conv[turn])["output_ids"])
            sent[i].append(load(p)["kv_bytes"] - b0)
            reused[i].append(load(d).get("disagg_prefix_reused_bytes_total", 0) - r0)
    return answers, sent, reused


@pytest.mark.parametrize("page", [1, 16])
def test_multi_turn_chat_reuses_decode_prefix(model_dir: str, page: int) -> None:
    prompts, want = conversations(model_dir, page)
    runs = {}
    for name, decode_flags in (("reuse", REUSE), ("plain", ())):
        c = PDCluster("tcp", model_path=model_dir, flags=flags(page), decode_flags=decode_flags)
        c.start()
        try:
            runs[name] = chat(c, prompts)
            p, d = c.prefills[0].url, c.decodes[0].url
            if name == "reuse":
                check_reuse_metrics(p, d, runs[name][2])
                check_n_on_reused_prefix(c, prompts[0][TURNS], want[0][TURNS])
                check_forged_prefix_fails(c, prompts[1][TURNS - 1])
            else:
                assert load(d).get("disagg_prefix_reused_bytes_total", 0) == 0
                assert not load(d)["radix_cache_enabled"]
            c.wait_pages_free()
        finally:
            c.stop()
    for name, (answers, _, _) in runs.items():
        for i in range(CONVERSATIONS):
            assert answers[i] == want[i][:TURNS], f"{name}: conversation {i} differs from unified"
    (_, sent_on, reused_on), (_, sent_off, reused_off) = runs["reuse"], runs["plain"]
    print(f"\npage {page}: P->D KV bytes per turn, reuse on {sent_on}, off {sent_off}; "
          f"reused on D {reused_on}")
    for i in range(CONVERSATIONS):
        assert sent_on[i][0] == sent_off[i][0] and reused_on[i][0] == 0  # nothing cached yet
        for turn in range(1, TURNS):
            assert reused_on[i][turn] > 0, (i, turn, reused_on)
            assert sent_on[i][turn] < sent_off[i][turn], (i, turn, sent_on, sent_off)
            # what was not sent is what D reused, byte for byte (one TP rank each side)
            assert sent_on[i][turn] + reused_on[i][turn] == sent_off[i][turn]
        assert all(r == 0 for r in reused_off[i])


def check_reuse_metrics(p: str, d: str, reused: list[list[int]]) -> None:
    dl, pl = load(d), load(p)
    assert dl["radix_cache_enabled"] and dl["disagg_prefix_reused_bytes_total"] == sum(map(
        sum, reused))
    assert dl["disagg_prefix_reused_tokens_total"] > 0 and pl["disagg_prefix_skipped_pages_total"] > 0
    assert metric(d, "pdserve_disagg_prefix_reused_bytes_total") == \
        dl["disagg_prefix_reused_bytes_total"]
    assert metric(d, "pdserve_disagg_prefix_reused_tokens_total") == \
        dl["disagg_prefix_reused_tokens_total"]
    assert metric(p, "pdserve_disagg_prefix_skipped_pages_total") == \
        pl["disagg_prefix_skipped_pages_total"]


def check_n_on_reused_prefix(c: PDCluster, prompt: list[int], want: list[int]) -> None:
    """3 greedy samples of the next turn: one transfer, the prefix from D's cache, every sample
    the unified answer."""
    d = c.decodes[0].url
    before = load(d)
    out = generate(c.url, prompt, sp={"n": 3})
    items = out if isinstance(out, list) else [out]
    assert [it["output_ids"] for it in items] == [want] * 3
    after = load(d)
    assert after["disagg_transfers_total"] - before["disagg_transfers_total"] == 1
    assert after["disagg_prefix_reused_tokens_total"] > before["disagg_prefix_reused_tokens_total"]


def check_forged_prefix_fails(c: PDCluster, cached: list[int]) -> None:
    """One room, two prompts of one length: D's starts with the prefix it holds, P's does not.
    D's digest proves them different; both fail with it named, nothing stays referenced, and
    the next request is served."""
    other = [(cached[0] + 1) % 1000 + 3] + cached[1:]
    room = 987654321
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": c.bootstrap_ports[0],
            "bootstrap_room": room}
    results: dict[str, httpx.Response] = {}

    def post(name: str, url: str, ids: list[int]) -> None:
        results[name] = httpx.post(url + "/generate", json={
            "input_ids": ids, "sampling_params": SAMPLING, **boot}, timeout=60)

    threads = [threading.Thread(target=post, args=("d", c.decodes[0].url, cached)),
               threading.Thread(target=post, args=("p", c.prefills[0].url, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert set(results) == {"d", "p"}, "a request hung"
    for name, r in results.items():  # the whole prompt's digest differs first: a client error
        assert r.status_code == 409, (name, r.status_code, r.text)
        assert "digest" in r.text, (name, r.text)
    c.wait_pages_free()
    generate(c.url, cached)  # still serves (and reuses)


# -- faults ------------------------------------------------------------------------------------
def shared(k: int) -> list[int]:
    """Prompts that share a 160-token prefix, then differ."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 1000) for _ in range(160)]
    return prefix + [3 + k, 4 + k, 5 + k, 6 + k, 7 + k]


def post_async(url: str, body: dict[str, Any], out: list) -> threading.Thread:
    def run() -> None:
        try:
            r = httpx.post(url + "/generate", json=body, timeout=90)
            out.append((r.status_code, r.text))
        except httpx.HTTPError as e:
            out.append((0, repr(e)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def fault_cluster(model_dir: str):
    c = PDCluster("tcp", model_path=model_dir, flags=flags(4), decode_flags=REUSE,
                  env=FAULT_ENV).start()
    try:
        yield c
    finally:
        c.stop()


def test_killed_prefill_and_decode_leave_no_page_referenced(fault_cluster: PDCluster) -> None:
    c = fault_cluster
    p, d = c.prefills[0], c.decodes[0]
    generate(c.url, shared(0))  # D caches the shared prefix
    # P frozen, then killed, while 4 shared-prefix requests wait on D: D reserves (and locks its
    # cached prefix pages) only once P confirmed it has the request, so they hold nothing
    os.killpg(p.proc.pid, signal.SIGSTOP)
    results: list = []
    threads = [post_async(d.url, {"input_ids": shared(k), "sampling_params": SAMPLING,
                                  "bootstrap_host": "127.0.0.1",
                                  "bootstrap_port": c.bootstrap_ports[0],
                                  "bootstrap_room": 5000 + k}, results) for k in range(1, 5)]
    wait(lambda: load(d.url)["disagg_prealloc_queue"] >= 4, 30,
         "D to claim the rooms of 4 requests (P is known already)")
    held = load(d.url)  # waiting for P's confirmation, they lock none of D's cached pages
    assert held["radix_cache_evictable_pages"] == held["radix_cache_pages"] > 0, held
    assert load_at_rest(held), held
    p.kill()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and all(s >= 500 for s, _ in results), results
    wait(lambda: load_at_rest(load(d.url)), 15, "D's pages back at rest")
    assert load(d.url)["radix_cache_pages"] > 0  # the cache survived; nothing references it
    p.start().wait_healthy(300)
    wait(lambda: httpx.get(c.url + "/readiness", timeout=5).status_code == 200, 30,
         "the router to re-admit the restarted prefill")
    before = load(d.url)["disagg_prefix_reused_tokens_total"]
    generate(c.url, shared(5))
    assert load(d.url)["disagg_prefix_reused_tokens_total"] > before  # still reused
    c.wait_pages_free(15)

    # D killed while P prefills shared-prefix requests (D's pages partly its cache)
    results = []
    threads = [post_async(c.url, {"input_ids": shared(k) + list(range(10, 400)),
                                  "sampling_params": SAMPLING}, results) for k in range(6, 10)]
    wait(lambda: load(p.url)["disagg_inflight_queue"] + load(p.url)["num_running_reqs"] > 0
         or len(results) == 4, 30, "P to start")
    d.kill()
    for t in threads:
        t.join(90)
    assert len(results) == 4, "a request hung after its decode died"
    wait(lambda: load_at_rest(load(p.url)),
         float(FAULT_ENV["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"]) + 20,
         "P's pages back at rest")
    d.start().wait_healthy(300)
    wait(lambda: httpx.get(c.url + "/readiness", timeout=5).status_code == 200, 30,
         "the router to re-admit the restarted decode")
    generate(c.url, shared(11))
    c.wait_pages_free(15)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_prefix_reuse_across_tp_sizes(model_dir: str, p_tp: int, d_tp: int) -> None:
    """P's TP ranks agree on D's prefix (one vote each, all-reduced with the poll states);
    every rank of a TP-2 decode locks the same cached pages and sends the same prefix."""
    page = 4
    prompts, want = conversations(model_dir, page)
    c = PDCluster("tcp", model_path=model_dir, flags=flags(page),
                  prefill_flags=("--tp-size", str(p_tp)),
                  decode_flags=(*REUSE, "--tp-size", str(d_tp))).start()
    try:
        d = c.decodes[0].url
        for turn, ids in enumerate(prompts[0][:3]):
            before = load(d).get("disagg_prefix_reused_tokens_total", 0)
            assert generate(c.url, ids)["output_ids"] == want[0][turn], f"turn {turn}"
            reused = load(d)["disagg_prefix_reused_tokens_total"] - before
            assert (reused > 0) == (turn > 0), (turn, reused)
        c.wait_pages_free()
    finally:
        c.stop()
