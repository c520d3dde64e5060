"""A dead engine is never a zombie (real servers on loopback, tiny random model):

- SIGKILL of the scheduler: in-flight requests (streaming and not) end with a 503 / an SSE
  error event, and the HTTP process exits non-zero within 10 s;
- SIGKILL of the HTTP process: the scheduler follows it (parent-death signal) and the bootstrap
  port is free again within a few seconds;
- a step that hangs past --watchdog-timeout ends the server non-zero.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdserve_testing import ServerProcess, free_port

from pdcore.testing.processes import pid_alive, spawned_children

FLAGS = ("--max-total-tokens", "4096", "--page-size", "4", "--skip-server-warmup")
LONG = {"text": "Tell me a long story.",
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0.0}}

pytestmark = pytest.mark.timeout(240)






def wait_running(server: ServerProcess, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    load: dict[str, Any] = {}
    while time.monotonic() < deadline:
        load = httpx.get(server.url + "/get_load", timeout=5).json()[0]
        if load["num_running_reqs"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests never ran: {load}")


def in_flight(server: ServerProcess) -> tuple[dict[str, Any], list[threading.Thread]]:
    """A non-streaming and a streaming long request in background threads."""
    results: dict[str, Any] = {}

    def plain() -> None:
        try:
            results["plain"] = httpx.post(server.url + "/generate", json=LONG, timeout=60)
        except httpx.HTTPError as e:
            results["plain"] = e

    def stream() -> None:
        try:
            with httpx.stream("POST", server.url + "/generate", json={**LONG, "stream": True},
                              timeout=60) as r:
                results["stream"] = [x for x in r.iter_lines() if x]
        except httpx.HTTPError as e:
            results["stream"] = e

    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    return results, threads


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_scheduler_kill_fails_requests_and_exits_server(tiny_llama_dir: Path,
                                                       tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"  # --crash-dump-folder: the requests of the last 5 minutes
    # a pool both long requests fit in: in 4096 tokens the newer one was preempted once the
    # two held ~2048 each (a few seconds at full speed), and a poll of /get_load that a loaded
    # CI machine held up that long never saw both running ("2 requests never ran" in 60 s)
    server = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS,
                           "--max-total-tokens", str(2 * 4096),
                           "--crash-dump-folder", str(dumps))
    try:
        server.wait_healthy(180)
        results, threads = in_flight(server)
        wait_running(server, 2)
        [scheduler] = spawned_children(server.proc.pid)
        t0 = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        rc = server.proc.wait(10)
        exit_s = time.monotonic() - t0
        for t in threads:
            t.join(10)
            assert not t.is_alive(), "a request hung after the scheduler died"
        assert rc == 1, server.log()[-3000:]
        plain = results["plain"]
        assert isinstance(plain, httpx.Response), plain
        assert plain.status_code == 503 and "scheduler process died" in plain.text
        assert "SIGKILL" in plain.text
        events = results["stream"]
        assert isinstance(events, list), events
        assert events[-1] == "data: [DONE]"
        assert "scheduler process died" in json.loads(events[-2][len("data: "):])["error"][
            "message"]
        [dump] = list(dumps.glob("crash_dump_*.json"))
        data = json.loads(dump.read_text())
        assert "scheduler process died" in data["reason"]
        assert len(data["requests"]) == 2, data["requests"]  # the two in flight, unfinished
        assert all(r["finished"] is None and r["input_ids"] and
                   r["sampling"]["max_new_tokens"] == 4000 for r in data["requests"])
        print(f"server exited {exit_s:.2f}s after its scheduler was killed")
    finally:
        server.stop()


def test_http_process_kill_takes_the_scheduler_and_frees_the_bootstrap_port(
        tiny_llama_dir: Path) -> None:
    boot = free_port()
    server = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS,
                           "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
                           "tcp", "--disaggregation-bootstrap-port", str(boot))
    try:
        server.wait_healthy(180)
        [scheduler] = spawned_children(server.proc.pid)
        assert not port_free(boot)
        t0 = time.monotonic()
        os.kill(server.proc.pid, signal.SIGKILL)  # the HTTP process alone, not its group
        server.proc.wait(10)
        deadline = t0 + 10
        while (pid_alive(scheduler) or not port_free(boot)) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone_s = time.monotonic() - t0
        assert not pid_alive(scheduler), "the scheduler outlived its HTTP process"
        assert port_free(boot), "the bootstrap port is still held"
        print(f"scheduler gone and bootstrap port free {gone_s:.2f}s after kill -9 of HTTP")
    finally:
        server.stop()


def test_hung_step_trips_the_watchdog(tiny_llama_dir: Path) -> None:
    server = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS, "--watchdog-timeout",
                           "2", command=("-m", "pdcore.testing.stuck_step"))
    try:
        server.wait_healthy(180)
        t0 = time.monotonic()
        r = httpx.post(server.url + "/generate", json=LONG, timeout=60)
        assert r.status_code == 503 and "--watchdog-timeout" in r.text, r.text
        rc = server.proc.wait(15)
        assert rc == 1
        assert time.monotonic() - t0 < 20
        log = server.log()
        assert "step stuck for more than --watchdog-timeout 2s" in log
        assert "stuck_step.py" in log  # the stuck stack is logged
    finally:
        server.stop()
