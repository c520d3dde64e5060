"""`--dp-size 2 --enable-dp-attention --tp-size 2` (real `pdserve serve`, tiny random MoE models).

Each DP rank is one process with its own scheduler and KV pool (attention TP 1); the MoE layers
span both processes (experts TP-sharded for Qwen2-MoE, whole experts per rank with --ep-size 2
for DeepSeek-V3's MLA model). Qwen3-MoE runs --tp-size 4: two ranks per DP rank. Checked against transformers' greedy output (near-tie rule):
- concurrent requests spread over both DP ranks (different prompt lengths: the ranks bring
  different row counts to every MoE layer);
- concurrent requests pinned to DP rank 0 only: rank 1 has nothing and must run idle steps for
  rank 0's collectives (without them the server hangs and the requests time out);
- a request dropped on one DP rank leaves the other rank's request running to its end;
- the pools come to rest; killing one DP rank's scheduler ends the server;
- dense models and a lone --enable-dp-lm-head are refused with exit 2.
"""

from __future__ import annotations

import concurrent.futures as cf
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
import torch
from pdserve_testing import ServerProcess

from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.greedy import Reference, check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import spawned_children
from pdcore.testing.tiny_models import make_tiny_model

NEW = 10
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4", "--dp-size", "2", "--tp-size", "2",
         "--enable-dp-attention")
# the last flags win: qwen3_moe runs TP 4, two attention ranks per DP rank (attention and the
# scheduler's agreement inside each pair, the MoE layers over all four)
CASES = {"qwen2_moe": (), "deepseek_v3": ("--ep-size", "2", "--enable-dp-lm-head"),
         "qwen3_moe": ("--tp-size", "4")}

pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]  # heavy: DP/TP process trees


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 47, 90, 1, 13, 30)]


class Served:
    def __init__(self, server: ServerProcess, refs: list[Reference]) -> None:
        self.server, self.refs = server, refs


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from transformers import AutoModelForCausalLM

    arch = request.param
    from pdcore.engine.model.tokenizer import default_model_file

    path = make_tiny_model(str(tmp_path_factory.mktemp("dpa") / arch), arch=arch, seed=9,
                           tokenizer_from=default_model_file())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, NEW) for p in _prompts()]
    del hf
    server = ServerProcess("--model-path", path, *FLAGS, *CASES[arch])
    try:
        yield Served(server.wait_healthy(300), refs)
    finally:
        server.stop()


def _generate(server: ServerProcess, ids: list[int], rank: int | None) -> list[int]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
    if rank is not None:
        body["data_parallel_rank"] = rank
    r = httpx.post(server.url + "/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _run_concurrently(s: Served, ranks: list[int | None]) -> list[str]:
    prompts = _prompts()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda i: _generate(s.server, prompts[i], ranks[i]),
                           range(len(prompts))))
    verdicts = [check_greedy(o, r) for o, r in zip(outs, s.refs)]
    assert verdicts.count("identical") >= len(verdicts) - 1, verdicts
    return verdicts


def test_requests_on_both_dp_ranks_match_transformers(served: Served) -> None:
    before = [d["finished_total"] for d in served.server.loads()]
    _run_concurrently(served, [0, 1, 0, 1, 1, 0])
    after = [d["finished_total"] for d in served.server.loads()]
    assert [a - b for a, b in zip(after, before)] == [3, 3]


def test_one_busy_dp_rank_and_one_idle_match_transformers(served: Served) -> None:
    then = served.server.loads()
    _run_concurrently(served, [0] * 6)
    now = served.server.loads()
    assert [d["finished_total"] - b["finished_total"] for d, b in zip(now, then)] == [6, 0]
    # rank 1 ran no step of its own, only idle forwards for rank 0's
    assert now[1]["steps_total"] == then[1]["steps_total"]
    assert now[1]["dp_idle_forwards_total"] > then[1]["dp_idle_forwards_total"]


def test_balanced_requests_and_pools_at_rest(served: Served) -> None:
    _run_concurrently(served, [None] * 6)
    deadline = time.monotonic() + 10
    while not all(load_at_rest(d) and d["num_reqs"] == 0 for d in served.server.loads()):
        assert time.monotonic() < deadline, served.server.loads()
        time.sleep(0.05)
    assert [d["dp_rank"] for d in served.server.loads()] == [0, 1]


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router not installed")
def test_through_sglang_router_dp_aware(served: Served) -> None:
    """sglang-router's regular mode with --dp-aware (URL@rank workers, the rank named in each
    request): transformers' tokens, both DP ranks serve."""
    from pdcore.testing.processes import free_port

    router = ServerProcess("--worker-urls", served.server.url, "--dp-aware", "--policy",
                           "round_robin", "--prometheus-host", "127.0.0.1",
                           "--prometheus-port", str(free_port()),
                           command=("-m", "sglang_router.launch_router"))
    try:
        router.wait_healthy(120)
        before = [d["finished_total"] for d in served.server.loads()]
        outs = [_generate(router, p, None) for p in _prompts()[:4]]
        after = [d["finished_total"] for d in served.server.loads()]
    finally:
        router.stop()
    verdicts = [check_greedy(o, r) for o, r in zip(outs, served.refs)]
    assert verdicts.count("identical") >= len(verdicts) - 1, verdicts
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_leaving_a_request_on_one_dp_rank_keeps_the_other(served: Served) -> None:
    """Rank 1's stream is dropped mid-way (an abort) while rank 0's runs on: rank 0 then steps
    alone (rank 1 idles) and its request completes."""
    def body(rank: int, new: int) -> dict[str, Any]:
        return {"input_ids": _prompts()[1], "stream": True, "data_parallel_rank": rank,
                "sampling_params": {"max_new_tokens": new, "temperature": 0.0,
                                    "ignore_eos": True}}

    aborted = [d["aborted_total"] for d in served.server.loads()]
    with httpx.Client(timeout=180) as client, client.stream(
            "POST", served.server.url + "/generate", json=body(0, 120)) as keep:
        kept = keep.iter_lines()
        first = [next(kept) for _ in range(2)]
        with client.stream("POST", served.server.url + "/generate",
                           json=body(1, 4000)) as drop:
            dropped = drop.iter_lines()
            for _ in range(2):
                next(dropped)
        rest = [x for x in kept if x]
    assert rest[-1] == "data: [DONE]"
    final = json.loads([x for x in first + rest if x.startswith("data: {")][-1][6:])
    assert len(final["output_ids"]) == 120
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    deadline = time.monotonic() + 10
    while [d["aborted_total"] for d in served.server.loads()] != [aborted[0], aborted[1] + 1]:
        assert time.monotonic() < deadline, served.server.loads()
        time.sleep(0.05)


def test_zz_killing_one_dp_rank_ends_the_server(served: Served) -> None:
    """Last for each model: the other DP rank's collectives fail, so the whole server exits."""
    victim = spawned_children(served.server.proc.pid)[1]
    os.kill(victim, signal.SIGKILL)
    assert served.server.proc.wait(60) == 1, served.server.log()[-3000:]


def _exit_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_dense_model_and_lone_dp_lm_head_exit_2(tiny_llama_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    dense = ["--model-path", str(tiny_llama_dir), "--dp-size", "2", "--tp-size", "2"]
    err = _exit_message([*dense, "--enable-dp-attention"], capsys)
    assert "--enable-dp-attention is for MoE models" in err and "LlamaForCausalLM" in err
    err = _exit_message([*dense, "--enable-dp-lm-head"], capsys)
    assert "--enable-dp-lm-head needs --enable-dp-attention" in err
    err = _exit_message(["--model-path", str(tiny_llama_dir), "--dp-size", "2", "--tp-size",
                         "3", "--enable-dp-attention"], capsys)
    assert "must be a multiple of --dp-size 2" in err
    assert parse_server_args([*dense]).enable_dp_attention is False
