"""`--enable-dp-attention --dp-size 2 --nnodes 2` as two real `pdserve serve` processes on
loopback (`--node-rank 0` serves HTTP and DP rank 0; `--node-rank 1` runs DP rank 1, whose
scheduler links to node 0 over zmq at the `--dist-init-addr` port + 1/+2): tiny random MoE
models, greedy output checked against transformers (near-tie rule).

- tiny DeepSeek-V3 (MLA, `--ep-size 2`) and Qwen2-MoE at TP 2 (one rank per DP rank), Qwen3-MoE
  at TP 4 (two attention ranks per DP rank, one DP rank per node): requests on both DP ranks,
  each DP rank serves (/get_load), the pools come to rest;
- PD: the two-node DeepSeek-V3 server as prefill, a one-node TP 1 decode over tcp, a request
  through each prefill DP rank; stopping node 0 then ends node 1 with exit 0;
- node 1 killed mid-request: the request fails naming node 1, node 0 exits 1 (bounded waits);
- plain `--dp-size 2 --tp-size 2 --nnodes 2` (no DP attention, a dense model): each replica's
  TP group spans both nodes; as a PD prefill server to a one-node decode;
- a DP size that leaves a DP attention rank split over nodes exits 2.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from pdserve_testing import ServerProcess

from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.greedy import Reference, check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import free_port, trust_prefill
from pdcore.testing.tiny_models import make_tiny_model

NEW = 8
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4", "--dp-size", "2", "--tp-size", "2",
         "--enable-dp-attention", "--nnodes", "2")
CASES = {"deepseek_v3": ("--ep-size", "2"), "qwen2_moe": (), "qwen3_moe": ("--tp-size", "4")}

pytestmark = [pytest.mark.timeout(500), pytest.mark.heavy]  # heavy: DP/TP process trees


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 40, 1, 23)]


def _model(tmp: Any, arch: str) -> tuple[str, list[Reference]]:
    from transformers import AutoModelForCausalLM

    from pdcore.engine.model.tokenizer import default_model_file

    path = make_tiny_model(str(tmp.mktemp("dpn") / arch), arch=arch, seed=11,
                           tokenizer_from=default_model_file())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p, NEW) for p in _prompts()]


class TwoNodes:
    def __init__(self, flags: tuple[str, ...]) -> None:
        # node 0's zmq links take the init port + 1 and + 2: all three claimed
        port = free_port(offsets=(0, 1, 2))
        common = (*flags, "--dist-init-addr", f"127.0.0.1:{port}")
        self.node1 = ServerProcess(*common, "--node-rank", "1")
        self.node0 = ServerProcess(*common, "--node-rank", "0")

    def wait(self) -> TwoNodes:
        self.node0.wait_healthy(400)
        return self

    def stop(self) -> None:
        self.node0.stop()
        self.node1.stop()


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[TwoNodes, list[Reference], str]]:
    path, refs = _model(tmp_path_factory, request.param)
    nodes = TwoNodes(("--model-path", path, *FLAGS, *CASES[request.param]))
    try:
        yield nodes.wait(), refs, request.param
    finally:
        nodes.stop()


def _body(ids: list[int], rank: int | None, new: int = NEW, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}, **extra}
    if rank is not None:
        body["data_parallel_rank"] = rank
    return body


def _generate(url: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(url + "/generate", json=body, timeout=240)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_both_nodes_dp_ranks_serve_transformers_tokens(served: Any) -> None:
    nodes, refs, arch = served
    url, prompts = nodes.node0.url, _prompts()
    before = [d["finished_total"] for d in nodes.node0.loads()]
    ranks = [0, 1, 1, 0]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda i: _generate(url, _body(prompts[i], ranks[i])),
                           range(len(prompts))))
    verdicts = [check_greedy(o, r) for o, r in zip(outs, refs)]
    assert verdicts.count("identical") >= len(verdicts) - 1, (arch, verdicts)
    loads = nodes.node0.loads()
    assert [d["dp_rank"] for d in loads] == [0, 1]
    assert [d["finished_total"] - b for d, b in zip(loads, before)] == [2, 2], loads
    per_node = "1..1" if arch != "qwen3_moe" else "2..3"
    assert f"runs TP ranks {per_node} as DP attention ranks 1..1" in nodes.node1.log()
    with pytest.raises(httpx.HTTPError):  # node 1 serves no HTTP
        httpx.get(nodes.node1.url + "/health", timeout=2)


def test_balanced_requests_and_pools_at_rest(served: Any) -> None:
    nodes, refs, _ = served
    url, prompts = nodes.node0.url, _prompts()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: _generate(url, _body(p, None)), prompts))
    verdicts = [check_greedy(o, r) for o, r in zip(outs, refs)]
    assert verdicts.count("identical") >= len(verdicts) - 1, verdicts
    deadline = time.monotonic() + 10
    while not all(load_at_rest(d) and d["num_reqs"] == 0 for d in nodes.node0.loads()):
        assert time.monotonic() < deadline, nodes.node0.loads()
        time.sleep(0.05)


def test_zz_killing_node_1_fails_its_request_and_ends_node_0(served: Any) -> None:
    nodes, _, arch = served
    if arch != "deepseek_v3":
        pytest.skip("one model is enough for the node failure")
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = _body(_prompts()[1], 1, new=4000, stream=True)
        with httpx.Client(timeout=120) as c, c.stream("POST", nodes.node0.url + "/generate",
                                                       json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) >= 2:
                    started.set()
        started.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(120), lines
    os.kill(nodes.node1.proc.pid, signal.SIGKILL)  # its processes die with it (death signal)
    t.join(120)
    assert not t.is_alive(), "the request on node 1's DP rank hung"
    text = "\n".join(lines)
    assert "node 1 is gone" in text, text[-2000:]
    assert nodes.node0.proc.wait(60) == 1, nodes.node0.log()[-3000:]


def _assert_pd_matches(prefill_url: str, decode_url: str, boot: int, refs: list) -> None:
    """Every prompt through prefill -> decode at once (room i: prefill DP rank i % 2, on node
    i % 2 with DP attention) gives transformers' tokens (near-tie rule)."""
    prompts = _prompts()
    trust_prefill(decode_url, boot)

    def through_pd(i: int) -> list[int]:
        body = _body(prompts[i], None, bootstrap_host="127.0.0.1", bootstrap_port=boot,
                     bootstrap_room=i)
        t = threading.Thread(target=lambda: httpx.post(prefill_url + "/generate", json=body,
                                                       timeout=240), daemon=True)
        t.start()
        out = _generate(decode_url, body)
        t.join(240)
        return out

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(through_pd, range(len(prompts))))
    verdicts = [check_greedy(o, r) for o, r in zip(outs, refs)]
    assert verdicts.count("identical") >= len(verdicts) - 1, verdicts



def test_prefill_on_two_nodes_to_one_node_decode(tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    path, refs = _model(tmp_path_factory, "deepseek_v3")
    boot = free_port()
    pd = ("--disaggregation-transfer-backend", "tcp")
    prefill = TwoNodes(("--model-path", path, *FLAGS, "--disaggregation-mode", "prefill",
                        "--disaggregation-bootstrap-port", str(boot), *pd))
    decode = None
    try:
        decode = ServerProcess("--model-path", path, "--max-total-tokens", "4096",
                               "--page-size", "4", "--disaggregation-mode", "decode", *pd)
        prefill.wait()
        decode.wait_healthy(400)
        _assert_pd_matches(prefill.node0.url, decode.url, boot, refs)
        done = [d["finished_total"] for d in prefill.node0.loads()]
        assert done == [2, 2], done
        for server in (prefill.node0, decode):
            deadline = time.monotonic() + 10
            while not all(load_at_rest(d) and d["num_reqs"] == 0 for d in server.loads()):
                assert time.monotonic() < deadline, server.loads()
                time.sleep(0.05)
        prefill.node0.stop()  # a clean stop of node 0 stops node 1's DP rank: exit 0
        assert prefill.node1.proc.wait(60) == 0, prefill.node1.log()[-3000:]
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()


def test_plain_dp_over_two_nodes_prefill_to_decode(tmp_path_factory: pytest.TempPathFactory
                                                   ) -> None:
    """`--dp-size 2 --tp-size 2 --nnodes 2`, no DP attention (a dense model): each replica is a
    TP group with one rank per node (SGLang's layout); as a PD prefill server, with each node's
    ranks learning the route secret from their replica's rank 0."""
    path, refs = _model(tmp_path_factory, "llama")
    boot = free_port()
    pd = ("--disaggregation-transfer-backend", "tcp")
    flags = ("--model-path", path, "--max-total-tokens", "4096", "--page-size", "4")
    prefill = TwoNodes((*flags, "--dp-size", "2", "--tp-size", "2", "--nnodes", "2",
                        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                        str(boot), *pd))
    decode = None
    try:
        decode = ServerProcess(*flags, "--disaggregation-mode", "decode", *pd)
        prefill.wait()
        decode.wait_healthy(400)
        _assert_pd_matches(prefill.node0.url, decode.url, boot, refs)
        assert [d["finished_total"] for d in prefill.node0.loads()] == [2, 2]
        assert "of each of 2 DP replicas" in prefill.node1.log()
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()


def test_dp_over_nodes_refusals_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--tp-size", "4", "--dp-size", "2", "--nnodes", "4", "--dist-init-addr",
            "127.0.0.1:5000", "--enable-dp-attention"]
    with pytest.raises(SystemExit) as e:
        parse_server_args(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "must be a multiple of --nnodes" in err, err
