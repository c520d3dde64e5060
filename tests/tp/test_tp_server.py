"""`pdserve serve --tp-size 2` as real processes: one node, and two "nodes" on loopback
(`--nnodes 2`: node 0 serves HTTP with rank 0, node 1 runs rank 1 only); greedy output equal
to the unified TP=1 engine; stopping node 0 stops node 1."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from tp_helpers import NEW

from pdcore.testing.processes import ServerProcess, free_port, spawned_children

pytestmark = pytest.mark.heavy  # TP process trees

FLAGS = ("--max-total-tokens", "16384", "--page-size", "4")


def _generate_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for ids in prompts:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
        r = httpx.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["output_ids"])
    return out


def test_two_nodes_on_loopback_match_unified(tiny_tp_model, prompts_and_unified):
    prompts, unified = prompts_and_unified
    addr = f"127.0.0.1:{free_port()}"
    common = ("--model-path", str(tiny_tp_model), "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", addr, *FLAGS)
    node1 = ServerProcess(*common, "--node-rank", "1")
    node0 = ServerProcess(*common, "--node-rank", "0")
    try:
        node0.wait_healthy(300)
        info = httpx.get(node0.url + "/get_server_info", timeout=10).json()
        assert (info["tp_size"], info["nnodes"]) == (2, 2)
        assert _generate_all(node0.url, prompts) == unified
        with pytest.raises(httpx.HTTPError):  # node 1 serves no HTTP
            httpx.get(node1.url + "/health", timeout=2)
        assert "runs TP ranks 1..1" in node1.log()
        node0.stop()
        deadline = time.monotonic() + 30
        while node1.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not node1.alive(), "node 1 kept running after node 0 stopped"
        assert node1.proc.returncode == 0, node1.log()[-3000:]
    finally:
        node0.stop()
        node1.stop()




def test_dead_rank_fails_the_server_instead_of_hanging(tiny_tp_model):
    server = ServerProcess("--model-path", str(tiny_tp_model), "--tp-size", "2", *FLAGS)
    try:
        server.wait_healthy(300)
        [scheduler] = spawned_children(server.proc.pid)
        [rank1] = spawned_children(scheduler)
        os.kill(rank1, signal.SIGKILL)
        # rank 0's next collective fails at once; the server then exits non-zero (a
        # supervisor restarts it) instead of answering 503 for ever
        rc = server.proc.wait(30)
        assert rc != 0
        assert "scheduler process died" in server.log()
    finally:
        server.stop()
