"""The first hour's rough edges (#45 item 4), with real processes on loopback:

- Ctrl-C (a real SIGINT to the whole process group, as a terminal sends it) stops `pdserve
  serve`, `pdserve router` and `pdserve up` without a traceback and leaves no process behind;
- `pdserve up` finds a busy port (router, server, bootstrap) before it starts anything and
  names its own flag for it (`--port`, `--server-port-base`, `--bootstrap-port-base`);
- a prefill or decode server's ready line shows no chat curl (those ports answer such a
  request 400); a unified server's does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pdserve_testing import REPO_ROOT, ServerProcess, free_port

from pdcore.errors import ConfigError
from pdcore.server.runner import try_line
from pdcore.up import UpConfig, check_ports

pytestmark = pytest.mark.timeout(300)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _ctrl_c(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGINT to the process group (a terminal's Ctrl-C); its exit code once it and every
    process of its group ended."""
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout)
    deadline = time.monotonic() + 15
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "a process of the group outlived Ctrl-C"
    return rc


def _assert_quiet(log: str) -> None:
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]


def test_ctrl_c_of_serve_and_router_prints_no_traceback(tiny_llama_dir: Path) -> None:
    server = ServerProcess("--model-path", str(tiny_llama_dir), "--max-total-tokens", "2048",
                           "--skip-server-warmup").wait_healthy(180)
    router = ServerProcess("--pd-disaggregation", "--prefill", server.url, "none", "--decode",
                           f"http://127.0.0.1:{free_port()}", command=("-m", "pdcore", "router"))
    try:
        deadline = time.monotonic() + 60
        while "Uvicorn running" not in router.log():
            assert router.alive() and time.monotonic() < deadline, router.log()
            time.sleep(0.2)
        assert "try: curl " in server.log()  # a unified server's first request
        for proc in (server, router):
            _ctrl_c(proc.proc)
    finally:
        server.stop()
        router.stop()
    _assert_quiet(server.log())
    _assert_quiet(router.log())


def test_ctrl_c_while_the_engine_process_imports_prints_no_traceback(tiny_llama_dir: Path
                                                                     ) -> None:
    """The spawned scheduler is still importing (unpickling its target) when Ctrl-C reaches
    the group: it must not die of it with a traceback; the HTTP process stops it."""
    server = ServerProcess("--model-path", str(tiny_llama_dir), "--max-total-tokens", "2048")
    try:
        deadline = time.monotonic() + 120
        while "scheduler process started" not in server.log():
            assert server.alive() and time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        _ctrl_c(server.proc)
    finally:
        server.stop()
    _assert_quiet(server.log())
    assert "exited with code -2" not in server.log(), server.log()  # not killed by the SIGINT
    assert "pdserve: engine failed to start" not in server.log()  # a stop, not a failure


def test_the_ready_line_of_prefill_and_decode_points_at_a_router() -> None:
    url = "http://127.0.0.1:30000"
    assert "/v1/chat/completions" in try_line(url, "null")
    for mode in ("prefill", "decode"):
        line = try_line(url, mode)
        assert "chat/completions" not in line and "pdserve router --pd-disaggregation" in line
        assert f"curl {url}/health" in line


def _taken(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


@pytest.mark.parametrize(("which", "flag"), [
    ("router", "--port"), ("prefill", "--server-port-base"), ("decode", "--server-port-base"),
    ("bootstrap", "--bootstrap-port-base")])
def test_up_names_its_own_flag_for_a_busy_port(which: str, flag: str) -> None:
    base, boot, port = free_port(offsets=(0, 100)), free_port(), free_port()
    cfg = UpConfig(port=port, server_port_base=base, bootstrap_port_base=boot)
    busy = {"router": port, "prefill": base, "decode": base + 100, "bootstrap": boot}[which]
    with _taken(busy), pytest.raises(ConfigError) as e:
        check_ports(cfg)
    assert f"pick another {flag}" in str(e.value) and str(busy) in str(e.value)
    check_ports(cfg)  # free again
    with pytest.raises(ConfigError, match="overlap"):
        check_ports(UpConfig(port=base, server_port_base=base, bootstrap_port_base=boot))


def test_router_names_its_flag_for_a_busy_port() -> None:
    port = free_port()
    with _taken(port):
        r = subprocess.run([sys.executable, "-m", "pdcore", "router", "--pd-disaggregation",
                            "--prefill", f"http://127.0.0.1:{free_port()}", "none", "--decode",
                            f"http://127.0.0.1:{free_port()}", "--port", str(port)],
                           capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT),
                           env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--port {port}: cannot listen" in r.stderr and "pick another --port" in r.stderr
    assert "Started server process" not in r.stdout + r.stderr


def test_up_checks_ports_before_loading_and_stops_on_ctrl_c(tiny_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    base, boot, port = free_port(offsets=(0, 100)), free_port(), free_port()
    cmd = [sys.executable, "-m", "pdcore", "up", "--model-path", str(tiny_llama_dir),
           "--backend", "tcp", "--port", str(port), "--server-port-base", str(base),
           "--bootstrap-port-base", str(boot), "--max-total-tokens", "2048",
           "--skip-server-warmup"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with _taken(port):  # the router's port is busy: exit 2 naming --port, no server started
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                           cwd=str(REPO_ROOT))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pick another --port" in r.stderr and "prefill-0:" not in r.stdout, r.stdout + r.stderr
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                              cwd=str(REPO_ROOT), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "pdserve: listening on" not in log.read_text():  # a server is loading
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        _ctrl_c(up)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    text = log.read_text()
    _assert_quiet(text)
    assert "pdserve up: stopping (interrupted)" in text
    for p in (base, base + 100, boot, port):  # every child is gone: its port is free again
        with _taken(p):
            pass
