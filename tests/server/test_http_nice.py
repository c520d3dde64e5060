"""PDSERVE_HTTP_NICE: once the engine started, every thread of the HTTP process (those started
later too) runs at the server's nice plus N; the scheduler process keeps the server's nice.
A bad value stops the start (exit 2). Runs the server in a child process: renicing is one way."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import json, os, sys, threading
from fake_server import FakeServer

base = os.getpriority(os.PRIO_PROCESS, 0)
server = FakeServer(sys.argv[1], context_length=256)
try:
    r = server.client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    done = threading.Event()
    late = threading.Thread(target=done.wait)  # a thread started after the renice
    late.start()
    nice = {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
    done.set()
    late.join()
    print(json.dumps({"base": base, "threads": list(nice.values()), "late": nice.get(late.native_id),
                      "scheduler": os.getpriority(os.PRIO_PROCESS, server.engine.pid)}))
finally:
    server.stop()
"""


def _room() -> None:
    """Start the child at nice 10 where allowed (tests run at nice 19, where +5 shows nothing)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 10)


def _run(model: Path, nice: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PDSERVE_HTTP_NICE": nice,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(model)], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=180, preexec_fn=_room)


def test_http_threads_are_niced_and_the_scheduler_is_not(tiny_llama_dir: Path) -> None:
    proc = _run(tiny_llama_dir, "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    base = got["base"]
    if base >= 19:
        pytest.skip("at nice 19 without CAP_SYS_NICE: no room to see +5")
    want = min(19, base + 5)
    assert len(got["threads"]) > 2  # the event loop, zmq's I/O threads, uvicorn's
    assert set(got["threads"]) == {want}, got
    assert got["late"] == want
    assert got["scheduler"] == base


def test_off_by_default_and_a_bad_value_stops_the_start(tiny_llama_dir: Path) -> None:
    proc = _run(tiny_llama_dir, "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got["threads"]) == {got["base"]} and got["scheduler"] == got["base"]
    bad = subprocess.run([sys.executable, "-m", "pdcore", "serve", "--model-path",
                          str(tiny_llama_dir), "--port", "1"],
                         env={**os.environ, "PDSERVE_HTTP_NICE": "-3"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "PDSERVE_HTTP_NICE" in bad.stderr + bad.stdout
