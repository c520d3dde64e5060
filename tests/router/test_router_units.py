"""Unit tests of the router's pure parts: circuit breaker, prefix tree, merge, policies."""

from __future__ import annotations

import json
import random

import pytest

from pdcore.errors import InvalidRequestError
from pdcore.router.circuit import CircuitBreaker, CircuitState
from pdcore.router.config import RouterConfig
from pdcore.router.health import parse_load
from pdcore.router.merge import (
    EchoSSEMerger,
    SSEMerger,
    batch_size,
    inject_bootstrap,
    merge_echo_json,
    merge_json,
    prefill_echo_logprobs,
    prefill_echo_stream,
    prefill_input_logprobs,
)
from pdcore.router.metrics import RouterMetrics
from pdcore.router.policies import CacheAwarePolicy, make_policy, routing_text
from pdcore.router.prefix_tree import PrefixTree, common_prefix_len
from pdcore.router.proxy import Proxy
from pdcore.router.workers import WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_circuit_breaker_state_machine():
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=3, success_threshold=2, timeout_s=10, clock=clock)
    cb.record(False), cb.record(False), cb.record(True)  # a success resets the count
    cb.record(False), cb.record(False)
    assert cb.state is CircuitState.CLOSED
    cb.record(False)
    assert cb.state is CircuitState.OPEN and not cb.allows_requests()
    clock.now = 9.9
    assert cb.state is CircuitState.OPEN
    clock.now = 10
    assert cb.state is CircuitState.HALF_OPEN and cb.allows_requests()
    cb.record(False)  # one failure in half-open re-opens
    assert cb.state is CircuitState.OPEN
    clock.now = 20
    cb.record(True)
    assert cb.state is CircuitState.HALF_OPEN
    cb.record(True)
    assert cb.state is CircuitState.CLOSED
    off = CircuitBreaker(1, 1, 1, enabled=False, clock=clock)
    off.record(False)
    assert off.allows_requests() and off.total_failures == 1


def test_prefix_tree_match_insert_evict():
    assert common_prefix_len("abcdef", "abcxyz") == 3
    assert common_prefix_len("abc", "abc") == 3 and common_prefix_len("", "a") == 0
    tree = PrefixTree()
    tree.insert("hello world")
    tree.insert("hello there")  # splits the edge at "hello "
    assert tree.match("hello world!") == 11
    assert tree.match("hello thx") == 8
    assert tree.match("help") == 3 and tree.match("xyz") == 0
    assert tree.size == len("hello ") + len("world") + len("there")
    tree.insert("zzzz")
    tree.insert("hello world")  # refresh: "there" is now the oldest leaf
    tree.evict_to(tree.size - 1)
    assert tree.match("hello there") == len("hello ")
    assert tree.match("hello world") == 11 and tree.match("zzzz") == 4


def test_batch_size_and_logprob_merge():
    assert batch_size("/generate", {"text": "a"}) is None
    assert batch_size("/generate", {"input_ids": [1, 2]}) is None
    assert batch_size("/generate", {"input_ids": [[1], [2], [3]]}) == 3
    assert batch_size("/v1/chat/completions", {"n": 1}) is None
    assert batch_size("/v1/chat/completions", {"n": 4}) == 4
    with pytest.raises(InvalidRequestError):
        batch_size("/v1/completions", {"prompt": []})
    p_sse = (b'data: {"index": 1, "meta_info": {"input_token_logprobs": [[1]]}}\n\n'
             b'data: {"index": 0, "meta_info": {"input_token_logprobs": [[0]]}}\n\n'
             b'data: {"index": 0, "meta_info": {"input_token_logprobs": [[9]]}}\n\n'
             b"data: [DONE]\n\n")
    found = prefill_input_logprobs(p_sse, streamed=True)
    assert found == {0: [[0]], 1: [[1]]}  # the first chunk per index wins
    merger = SSEMerger(found)
    d_sse = (b'data: {"index": 1, "meta_info": {"input_token_logprobs": [[5]]}}\r\n\r\n'
             b'data: {"meta_info": {"input_token_logprobs": "not a list"}}\n\n'
             b"data: [DONE]\n\n")
    out = b"".join(merger.feed(d_sse[i:i + 7]) for i in range(0, len(d_sse), 7)) + merger.flush()
    events = [e for e in out.replace(b"\r\n", b"\n").split(b"\n\n") if e]
    assert json.loads(events[0][6:])["meta_info"]["input_token_logprobs"] == [[1], [5]]
    assert json.loads(events[1][6:])["meta_info"]["input_token_logprobs"] == "not a list"
    assert events[2] == b"data: [DONE]"
    merged = merge_json(b'{"meta_info": {"input_token_logprobs": [[7]]}}', {0: [[0]]})
    assert json.loads(merged)["meta_info"]["input_token_logprobs"] == [[0], [7]]
    assert merge_json(b'{"choices": []}', {0: [[0]]}) is None  # no key on decode: unchanged


def test_parse_load_shapes():
    assert parse_load([{"num_tokens": 3}, {"num_tokens": 4}]) == 7
    assert parse_load({"load": 5}) == 5
    assert parse_load({"loads": [1]}) == -1 and parse_load("x") == -1


def _registry(n: int, role: str = "decode") -> WorkerRegistry:
    reg = WorkerRegistry(RouterConfig())
    for i in range(n):
        reg.add(f"http://127.0.0.1:{40000 + i}", role, healthy=True)
    return reg


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced():
    cfg = RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    reg = _registry(2)
    a, b = reg.of_type("decode")
    policy = CacheAwarePolicy(cfg, random.Random(0))
    assert policy.select([a, b], "shared prefix text") in (a, b)
    first = policy.select([a, b], "shared prefix text")
    assert policy.select([a, b], "shared prefix text") is first  # affinity
    first.in_flight = 10  # now imbalanced: 10 vs 0
    other = b if first is a else a
    assert policy.select([a, b], "shared prefix text") is other
    policy.forget(first)
    assert first.url not in policy.tree_sizes()


def test_power_of_two_and_random_stay_in_set():
    reg = _registry(3)
    workers = reg.of_type("decode")
    workers[0].load, workers[1].load, workers[2].load = 50, 0, 100
    p2 = make_policy("power_of_two", RouterConfig(), random.Random(1))
    picks = [p2.select(workers, "") for _ in range(200)]
    assert workers[2] not in picks  # the most loaded never wins a pair
    assert picks.count(workers[1]) > picks.count(workers[0])
    rnd = make_policy("random", RouterConfig(), random.Random(2))
    assert {rnd.select(workers, "").url for _ in range(100)} == {w.url for w in workers}


def test_routing_text():
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert routing_text("/v1/chat/completions", chat) == "SU"
    assert routing_text("/v1/completions", {"prompt": ["p1", "p2"]}) == "p1"
    assert routing_text("/generate", {"text": "t"}) == "t"
    assert routing_text("/generate", {"input_ids": [[1, 2], [3]]}) == "1 2"
    # /v1/responses: its input text, or its items' contents (#45 item 7)
    assert routing_text("/v1/responses", {"input": "hi"}) == "hi"
    assert routing_text("/v1/responses", {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "A"}]},
        {"type": "function_call_output", "call_id": "c", "output": "B"},
        {"role": "user", "content": "C"}]}) == "AC"
    assert batch_size("/v1/responses", {"input": ["x", "y"], "n": 3}) is None


def test_backoff_grows_with_jitter_and_cap():
    cfg = RouterConfig(retry_initial_backoff_ms=50, retry_backoff_multiplier=1.5,
                       retry_max_backoff_ms=100, retry_jitter_factor=0.2)
    proxy = Proxy(cfg, _registry(0), None, None, None, RouterMetrics(),  # type: ignore[arg-type]
                  rng=random.Random(3))
    for retry, base in ((1, 0.050), (2, 0.075), (3, 0.1), (9, 0.1)):
        for _ in range(20):
            assert base * 0.8 <= proxy.backoff_s(retry) <= base * 1.2


def test_bootstrap_fields_from_prefill_url():
    reg = WorkerRegistry(RouterConfig())
    v6 = reg.add("http://[::1]:30000/", "prefill", 8998)
    host = reg.add("https://Prefill-0.example:443", "prefill", None)
    assert v6.url == "http://[::1]:30000" and v6.bootstrap_host == "::1"
    assert host.bootstrap_host == "prefill-0.example"
    rooms = {inject_bootstrap({"text": "x"}, v6, None)["bootstrap_room"] for _ in range(50)}
    assert len(rooms) == 50 and all(0 <= r < 2**63 for r in rooms)
    out = inject_bootstrap({"text": ["a", "b"]}, v6, 2)
    assert out["bootstrap_host"] == ["::1", "::1"] and out["bootstrap_port"] == [8998, 8998]


def test_signed_routes_name_the_decode_server_and_the_body():
    """route_auth v2: each room's signature names the chosen decode server and the body as
    sent (route fields aside); a D that answers 403 as another instance gets re-signed for."""
    from types import SimpleNamespace

    from pdcore.route_auth import RouteGuard, body_digest, route_key
    from pdcore.router.proxy import _resigned

    reg = WorkerRegistry(RouterConfig())
    p = reg.add("http://127.0.0.1:30000", "prefill", 8998)
    body = {"text": ["a", "b"], "data_parallel_rank": 1}
    out = inject_bootstrap(body, p, 2, route_key("s"), "d-1")
    guard = RouteGuard("s", local=False, decode_id="d-1")
    for room, sig in zip(out["bootstrap_room"], out["bootstrap_sig"]):
        assert sig.split(".")[2] == "d-1"
        assert guard.check(room, "127.0.0.1", 8998, sig, 8998, body_digest(json.loads(
            json.dumps(out)))) == ""
    d = reg.add("http://127.0.0.1:30001", "decode", None)
    d.server_id = "old"
    refused = json.dumps({"error": {"message": "...", "code": "route_refused"}}).encode()
    assert _resigned(SimpleNamespace(status=403, server_id="old", body=refused), d) is None
    assert _resigned(SimpleNamespace(status=200, server_id="new", body=b"{}"), d) is None
    # #46: only a refused route is re-signed for, by its code (a 403 of another reason is not)
    other = json.dumps({"error": {"message": "route refused", "code": 403}}).encode()
    assert _resigned(SimpleNamespace(status=403, server_id="new", body=other), d) is None
    f = _resigned(SimpleNamespace(status=403, server_id="new", body=refused), d)
    assert f is not None and f.retriable and d.server_id == "new"


def _choice(tokens: list[str], text: str, index: int = 0) -> dict:
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"index": index, "text": text, "logprobs": {
        "tokens": tokens, "token_logprobs": [None] + [-1.0] * (len(tokens) - 1),
        "top_logprobs": [None] * len(tokens), "text_offset": offsets}}


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


def test_streamed_echo_takes_the_prefill_echo_chunk() -> None:
    """P's stream: the echo chunk (prompt entries) then its token; D's: an echo chunk with no
    entries, then tokens. D's echo chunk of each index takes P's, whatever way D's bytes are
    cut; later chunks, and an index P never echoed, are left alone."""
    p = _sse({"choices": [_choice(["a", "b"], "ab", 0)]}, {"choices": [_choice(["X"], "X", 0)]},
             {"choices": [_choice(["c"], "c", 1)]})
    found = prefill_echo_stream(p)
    assert sorted(found) == [0, 1] and found[0]["tokens"] == ["a", "b"]
    d = _sse({"choices": [_choice([], "ab", 0)]}, {"choices": [_choice([], "c", 1)]},
             {"choices": [_choice(["X"], "X", 0)]}, {"choices": [_choice([], "", 2)]})
    for cut in (1, 7, len(d)):
        merger = EchoSSEMerger(dict(found))
        out = b"".join(merger.feed(d[i:i + cut]) for i in range(0, len(d), cut)) + \
            merger.flush()
        got = [c["choices"][0] for c in
               (json.loads(ln[5:]) for ln in out.split(b"\n") if ln.startswith(b"data: {"))]
        assert [c["logprobs"]["tokens"] for c in got] == [["a", "b"], ["c"], ["X"], []]
        assert out.endswith(b"data: [DONE]\n\n")


def test_echo_merge_puts_prefill_prompt_entries_first() -> None:
    p = json.dumps({"choices": [_choice(["a", "b", "X"], "abX")]}).encode()
    found = prefill_echo_logprobs(p)
    # D sampled X, Y (X was P's): P's entries without X go first
    d = {"choices": [_choice(["X", "Y"], "abXY")]}
    d["choices"][0]["logprobs"]["text_offset"] = [2, 3]
    merged = json.loads(merge_echo_json(json.dumps(d).encode(), found))["choices"][0]
    assert merged["logprobs"]["tokens"] == ["a", "b", "X", "Y"]
    assert merged["logprobs"]["text_offset"] == [0, 1, 2, 3]
    # max_tokens 0: D sampled nothing; P still sampled X, which is dropped
    d0 = json.dumps({"choices": [_choice([], "ab")]}).encode()
    assert json.loads(merge_echo_json(d0, found))["choices"][0]["logprobs"]["tokens"] == \
        ["a", "b"]
    # not the expected shape (P's token is not D's first): D's answer is left alone
    odd = json.dumps({"choices": [_choice(["Z"], "abZ")]}).encode()
    assert merge_echo_json(odd, found) is None
    assert merge_echo_json(b"not json", found) is None and prefill_echo_logprobs(b"[]") == {}
