"""The router's cache_aware policy over 2 prefill servers with the prefix cache: on a workload of
shared prefixes it keeps each prefix on one prefill server, so the prefill-side hit rate (the
responses' cached_tokens over their prompt tokens) beats round_robin's, and every greedy answer
is the same token for token under both policies."""

from __future__ import annotations

import random

import httpx
import pytest
from helpers import generate

from pdcore.testing.processes import PDCluster
from pdcore.testing.tiny_models import make_tiny_model

PREFIXES, PREFIX_LEN, QUESTION_LEN, PAGE = 4, 128, 8, 16
SAMPLING = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcore.engine.model.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("prefix_router") / "m"),
                           tokenizer_from=default_model_file(), max_positions=8192)


def workload() -> list[list[int]]:
    """3 rounds over 4 prefixes, each with a fresh question. Round r's order puts every prefix
    at a position of the other parity than in round r-1: round robin over 2 prefill servers
    then alternates each prefix between them whatever server it starts on, so it computes
    every prefix on both."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(100, 40000) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    orders = ([0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 0, 1])
    return [prefixes[j] + [rng.randrange(100, 40000) for _ in range(QUESTION_LEN)]
            for order in orders for j in order]


def run_policy(c: PDCluster, policy: str, prompts: list[list[int]]) -> list[dict]:
    """The prompts one at a time through a fresh router with `policy` over c's workers (whose
    caches are flushed first); the router is stopped after."""
    for s in c.prefills + c.decodes:
        r = httpx.post(s.url + "/flush_cache", timeout=30, headers=s.admin_headers)
        assert r.status_code == 200, r.text
    view = PDCluster("tcp", prefill=0, decode=0, env=c.env, policy=policy)
    view.prefills, view.decodes, view.bootstrap_ports = c.prefills, c.decodes, c.bootstrap_ports
    view.start(60)
    try:
        return [generate(view.url, p, sampling_params=SAMPLING) for p in prompts]
    finally:
        view.router.stop()


def hit_rate(outs: list[dict]) -> float:
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return cached / sum(o["meta_info"]["prompt_tokens"] for o in outs)


def test_cache_aware_beats_round_robin_with_identical_answers(tiny_dir: str) -> None:
    prompts = workload()
    c = PDCluster("tcp", prefill=2, decode=1, model_path=tiny_dir, flags=(
        "--max-total-tokens", "4096", "--page-size", str(PAGE)))
    c.start()
    try:
        aware = run_policy(c, "cache_aware", prompts)
        rr = run_policy(c, "round_robin", prompts)
        for o in aware + rr:
            assert 0 <= o["meta_info"]["cached_tokens"] <= o["meta_info"]["prompt_tokens"]
        # cache_aware computes each prefix once: every later request of a prefix hits it
        later = aware[PREFIXES:]  # round 0 holds each prefix's first request
        assert all(o["meta_info"]["cached_tokens"] >= PREFIX_LEN // PAGE * PAGE for o in later), \
            [o["meta_info"]["cached_tokens"] for o in aware]
        assert hit_rate(aware) > hit_rate(rr), (hit_rate(aware), hit_rate(rr))
        for i, (a, b) in enumerate(zip(aware, rr)):
            assert a["output_ids"] == b["output_ids"], f"request {i}: answers differ by policy"
            assert len(a["output_ids"]) == SAMPLING["max_new_tokens"]
        # flushed, every pool is back to all pages free: nothing was left referenced
        for s in c.prefills + c.decodes:
            assert httpx.post(s.url + "/flush_cache", timeout=30,
                              headers=s.admin_headers).status_code == 200
        c.wait_pages_free()
    finally:
        c.stop()
