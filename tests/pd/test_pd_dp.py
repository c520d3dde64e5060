"""DP-aware PD (`--dp-size` on prefill and/or decode, tiny random Llama, tcp backend).

- P dp2 -> D dp1, P dp1 -> D dp2, P dp2 -> D dp2: greedy output equals transformers (near-tie
  rule) through `pdserve router` and the real `sglang-router`; every replica of a dp2 side
  serves; every KV pool is at rest afterwards; the same for a tiny MoE and an MLA model with
  DP attention (dp2 x tp2) on P or on D (on both: tests/pd/test_pd_spec_dp.py);
- `pdserve router --dp-aware`: a dp2 server becomes two workers URL@rank; requests carry the
  rank, and every P and D rank serves; `--prefill-round-robin-balance`: P's replicas take turns;
- a request in flight on one D replica survives the abort of one on the other replica;
- a prefill rank named out of range is refused (400 on P, a failed room on D), nothing leaks;
- killing one replica's scheduler ends that server (exit 1).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import PDCluster, ServerProcess, free_port, spawned_children
from pdcore.testing.tiny_models import make_tiny_model

NEW = 8
KEEP = 2000  # new tokens of a request that stays in flight while another one is aborted
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4")
PROMPTS = [[1, 17, 300, 42, 99, 7], [5, 250, 61, 9, 3, 77, 12], [400, 2, 8, 31], [64, 65, 66]]
HAVE_SGLANG_ROUTER = importlib.util.find_spec("sglang_router") is not None

pytestmark = [pytest.mark.timeout(600), pytest.mark.heavy]  # heavy: DP/TP process trees


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcore.engine.model.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("pddp") / "m"),
                           tokenizer_from=default_model_file(), max_positions=8192)


@pytest.fixture(scope="module")
def refs(model_dir: str) -> list[Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return [hf_greedy(model, ids, NEW) for ids in PROMPTS]


def _cluster(model_dir: str, p_dp: int, d_dp: int) -> PDCluster:
    return PDCluster("tcp", model_path=model_dir, flags=FLAGS,
                     prefill_flags=("--dp-size", str(p_dp)),
                     decode_flags=("--dp-size", str(d_dp))).start()


def _router(c: PDCluster, *extra: str, kind: str = "pdcore") -> ServerProcess:
    args = ["--pd-disaggregation", "--prefill", c.prefills[0].url, str(c.bootstrap_ports[0]),
            "--decode", c.decodes[0].url, "--policy", "round_robin", *extra]
    if kind == "sglang":
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return ServerProcess(*args, command=("-m", "sglang_router.launch_router")
                             ).wait_healthy(120)
    return ServerProcess(*args, "--health-check-interval-secs", "1",
                         command=("-m", "pdcore.router")).wait_healthy(120)


def _generate(url: str, ids: list[int], new: int = NEW, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0,
                                                  "ignore_eos": True}, **extra}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def requests_per_rank(server: ServerProcess) -> list[int]:
    return [d["disagg_requests_total"] for d in server.loads()]


def wait_at_rest(c: PDCluster, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = [d for s in c.prefills + c.decodes for d in s.loads()]
        if all(load_at_rest(d) and d["num_reqs"] == 0 for d in now):
            return
        assert time.monotonic() < deadline, f"KV pools not at rest: {now}"
        time.sleep(0.1)


def _check_greedy_through(url: str, refs: list[Any], p_dp: int = 1) -> None:
    """Greedy of every prompt through a router; with p_dp > 1 prompt i names prefill replica
    i % p_dp (the router passes disagg_prefill_dp_rank to both roles), so each one serves
    whatever the random rooms."""
    for i, (ids, ref) in enumerate(zip(PROMPTS, refs)):
        extra = {"disagg_prefill_dp_rank": i % p_dp} if p_dp > 1 else {}
        out = _generate(url, ids, **extra)
        verdict = check_greedy(out["output_ids"], ref)
        assert verdict.startswith(("identical", "near-tie")), (ids, verdict)


def _serve_shape(c: PDCluster, refs: list[Any]) -> None:
    """Greedy through both routers; every replica of a DP side serves; pools at rest."""
    before = [requests_per_rank(s) for s in (c.prefills[0], c.decodes[0])]
    _check_greedy_through(c.url, refs, len(before[0]))
    if HAVE_SGLANG_ROUTER:  # prefill's replica from the room here
        sg = _router(c, kind="sglang")
        try:
            _check_greedy_through(sg.url, refs)
        finally:
            sg.stop()
    after = [requests_per_rank(s) for s in (c.prefills[0], c.decodes[0])]
    runs = 2 if HAVE_SGLANG_ROUTER else 1
    for b, a in zip(before, after):
        assert sum(a) - sum(b) == runs * len(PROMPTS), (before, after)
        if len(a) > 1:
            assert all(x > y for x, y in zip(a, b)), f"a replica served nothing: {b} -> {a}"
    wait_at_rest(c)


@pytest.mark.parametrize("p_dp,d_dp", [(2, 1), (1, 2)], ids=["p2d1", "p1d2"])
def test_pd_dp_shapes_match_transformers(model_dir: str, refs: list[Any], p_dp: int,
                                         d_dp: int) -> None:
    c = _cluster(model_dir, p_dp, d_dp)
    try:
        _serve_shape(c, refs)
    finally:
        c.stop()


_DPA = ("--dp-size", "2", "--tp-size", "2", "--enable-dp-attention")
# DP attention on both sides: tests/pd/test_pd_spec_dp.py (both MoE families, with draft heads;
# the tokens equal a plain engine's, itself checked against transformers in tests/engine)
_DPA_SHAPES = {"p2d1": (_DPA, ()), "p1d2": ((), _DPA)}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[Any]]]:
    """Tiny Qwen2-MoE and DeepSeek-V3 (MLA) folders with transformers' greedy references,
    each built on first use."""
    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, arch: str) -> tuple[str, list[Any]]:
            import torch
            import transformers

            from pdcore.engine.model.tokenizer import default_model_file

            path = make_tiny_model(str(tmp_path_factory.mktemp("pddpa") / arch), arch=arch,
                                   seed=9, tokenizer_from=default_model_file())
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32).eval()
            self[arch] = (path, [hf_greedy(hf, ids, NEW) for ids in PROMPTS])
            return self[arch]

    return Lazy()


@pytest.mark.parametrize("shape", list(_DPA_SHAPES))
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_dp_attention_pd_shapes_match_transformers(
        moe_models: dict[str, tuple[str, list[Any]]], arch: str, shape: str) -> None:
    """Tiny MoE and MLA models, `--dp-size 2 --enable-dp-attention --tp-size 2` on P, on D or
    on both (the other side TP 1, one replica): through pdserve router and sglang-router the
    tokens match transformers, every DP rank of a DP side serves, the pools come to rest."""
    path, refs = moe_models[arch]
    p_flags, d_flags = _DPA_SHAPES[shape]
    c = PDCluster("tcp", model_path=path, flags=FLAGS, prefill_flags=p_flags,
                  decode_flags=d_flags).start()
    try:
        _serve_shape(c, refs)
    finally:
        c.stop()


# ---- P dp2 -> D dp2, one cluster for the rest -----------------------------------------------
@pytest.fixture(scope="module")
def p2d2(model_dir: str) -> Iterator[PDCluster]:
    c = _cluster(model_dir, 2, 2)
    try:
        yield c
    finally:
        c.stop()


def test_p2d2_matches_transformers(p2d2: PDCluster, refs: list[Any]) -> None:
    _serve_shape(p2d2, refs)


def test_dp_aware_router_routes_to_each_rank(p2d2: PDCluster, refs: list[Any]) -> None:
    router = _router(p2d2, "--dp-aware")
    try:
        workers = httpx.get(router.url + "/workers", timeout=10).json()
        urls = sorted(w["url"] for w in workers["workers"])
        p, d = p2d2.prefills[0].url, p2d2.decodes[0].url
        assert urls == sorted([f"{p}@0", f"{p}@1", f"{d}@0", f"{d}@1"]), workers
        before = [requests_per_rank(s) for s in (p2d2.prefills[0], p2d2.decodes[0])]
        _check_greedy_through(router.url, refs)  # round robin: each rank twice
        after = [requests_per_rank(s) for s in (p2d2.prefills[0], p2d2.decodes[0])]
        for b, a in zip(before, after):
            assert [x - y for x, y in zip(a, b)] == [2, 2], (before, after)
    finally:
        router.stop()
    wait_at_rest(p2d2)


def test_prefill_round_robin_balance_alternates_prefill_replicas(p2d2: PDCluster) -> None:
    router = _router(p2d2, "--prefill-round-robin-balance")
    try:
        before = requests_per_rank(p2d2.prefills[0])
        for ids in PROMPTS:
            _generate(router.url, ids, new=2)
        after = requests_per_rank(p2d2.prefills[0])
        assert [a - b for a, b in zip(after, before)] == [2, 2], (before, after)
    finally:
        router.stop()
    wait_at_rest(p2d2)


def _pd_pair(c: PDCluster, ids: list[int], new: int, d_rank: int, p_rank: int | None,
             room: int) -> tuple[dict[str, Any], threading.Thread, list[Any]]:
    """The router's fan-out by hand: P's call in a thread, D's body (to stream) returned."""
    body: dict[str, Any] = {
        "input_ids": ids, "stream": True, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": c.bootstrap_ports[0], "bootstrap_room": room,
        "data_parallel_rank": d_rank,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
    if p_rank is not None:
        body["disagg_prefill_dp_rank"] = p_rank
    got: list[Any] = []

    def prefill() -> None:
        try:
            got.append(httpx.post(c.prefills[0].url + "/generate", json={**body, "stream": False},
                                  timeout=120).status_code)
        except httpx.HTTPError as e:
            got.append(e)

    t = threading.Thread(target=prefill, daemon=True)
    t.start()
    return body, t, got


def test_request_on_one_replica_survives_abort_on_the_other(p2d2: PDCluster) -> None:
    wait_at_rest(p2d2)
    d = p2d2.decodes[0]
    aborted_before = [x["aborted_total"] for x in d.loads()]
    rng = random.Random(7)
    keep_body, keep_p, _ = _pd_pair(p2d2, PROMPTS[0], KEEP, 0, None, rng.getrandbits(62))
    drop_body, drop_p, _ = _pd_pair(p2d2, PROMPTS[1], 6000, 1, 1, rng.getrandbits(62))
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", d.url + "/generate", json=keep_body) as keep:
        assert keep.status_code == 200
        kept = keep.iter_lines()
        first = [next(kept) for _ in range(2)]
        with client.stream("POST", d.url + "/generate", json=drop_body) as drop:
            assert drop.status_code == 200
            dropped = drop.iter_lines()
            for _ in range(2):
                next(dropped)
        # the client left D replica 1's request while replica 0's was running; it goes on
        assert d.loads()[0]["num_reqs"] == 1
        rest = [x for x in kept if x]
    events = [json.loads(x[len("data: "):]) for x in first + rest if x.startswith("data: {")]
    assert rest[-1] == "data: [DONE]"
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length", events[-1]
    assert len(events[-1]["output_ids"]) == KEEP
    keep_p.join(30)
    drop_p.join(30)
    wait_at_rest(p2d2)
    now = [x["aborted_total"] for x in d.loads()]
    assert now == [aborted_before[0], aborted_before[1] + 1], (aborted_before, now)


def test_prefill_rank_out_of_range_is_refused_without_leaks(p2d2: PDCluster) -> None:
    r = httpx.post(p2d2.prefills[0].url + "/generate", timeout=30, json={
        "input_ids": PROMPTS[0], "bootstrap_host": "127.0.0.1", "bootstrap_room": 12345,
        "bootstrap_port": p2d2.bootstrap_ports[0], "disagg_prefill_dp_rank": 2,
        "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "disagg_prefill_dp_rank" in r.text, r.text
    r = httpx.post(p2d2.decodes[0].url + "/generate", timeout=60, json={
        "input_ids": PROMPTS[0], "bootstrap_host": "127.0.0.1", "bootstrap_room": 12346,
        "bootstrap_port": p2d2.bootstrap_ports[0], "disagg_prefill_dp_rank": 5,
        "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code >= 400 and "out of range" in r.text, r.text
    wait_at_rest(p2d2)
    _generate(p2d2.url, PROMPTS[2], new=2)  # both servers still serve


def test_zz_killing_one_decode_replica_ends_the_server(p2d2: PDCluster) -> None:
    """Last in this module: it takes the decode server down."""
    d = p2d2.decodes[0]
    children = spawned_children(d.proc.pid)
    assert len(children) == 2, children
    os.kill(children[1], signal.SIGKILL)
    assert d.proc.wait(30) == 1, d.log()[-3000:]
    assert httpx.get(p2d2.prefills[0].url + "/health", timeout=10).status_code == 200
