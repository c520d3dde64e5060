"""Test servers never outlive the test process: a server started through ServerProcess, by a
python that is then SIGKILLed (as an OOM kill or a CI timeout ends pytest), is gone with its
whole process group (HTTP process and scheduler) within seconds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

from pdcore.testing.processes import ServerProcess

CHILD = textwrap.dedent("""
    import sys, time
    from pdcore.testing.processes import ServerProcess
    server = ServerProcess("--model-path", sys.argv[1], "--max-total-tokens", "1024",
                           "--log-level", "warning")
    server.wait_healthy(180)
    print(server.proc.pid, server.url, server.tmp_dir, flush=True)
    time.sleep(600)
""")


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the parenthesised command: state ppid pgrp ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def _wait_gone(pgid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_server_dies_with_killed_test_process(tiny_llama_dir: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_llama_dir)],
                             stdout=subprocess.PIPE, text=True)
    pgid, tmp = None, None
    try:
        line = child.stdout.readline()  # the child exits (EOF) if the server fails to start
        assert line, f"the child failed to start its server (exit {child.wait(30)})"
        pid_text, url, tmp = line.split()
        pgid = int(pid_text)
        assert os.getpgid(pgid) == pgid, "the server must lead its own process group"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        members = _group(pgid)
        assert len(members) >= 2, f"expected the server and its scheduler, got {members}"

        child.send_signal(signal.SIGKILL)
        child.wait(10)
        left = _wait_gone(pgid, timeout=20)
        assert not left, f"processes of the killed test's server group still alive: {left}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if pgid is not None and _group(pgid):
            os.killpg(pgid, signal.SIGKILL)  # clean up after a failed assertion
        if tmp is not None:  # the killed child could not remove its server's folder
            shutil.rmtree(tmp, ignore_errors=True)


def test_stop_kills_the_whole_group(tiny_llama_dir: Path) -> None:
    server = ServerProcess("--model-path", str(tiny_llama_dir), "--max-total-tokens", "1024",
                           "--log-level", "warning")
    try:
        server.wait_healthy(180)
        pgid = server.proc.pid
        assert len(_group(pgid)) >= 2
        assert list(server.tmp_dir.glob("pdserve-ipc-*")), "the server's TMPDIR is its folder"
    finally:
        server.stop()
    assert not _wait_gone(pgid, timeout=10)
    assert not server.tmp_dir.exists()


def test_no_socket_folder_outlives_its_server(tiny_llama_dir: Path) -> None:
    """The HTTP process's private IPC folder goes when the server stops, and when it is
    SIGKILLed alone (the OOM killer's way): then its scheduler, stopped by die_with_parent's
    SIGTERM, removes it."""
    tmp = Path(tempfile.mkdtemp(prefix="pdt-"))  # short: a unix socket path holds 107 bytes
    flags = ("--model-path", str(tiny_llama_dir), "--max-total-tokens", "1024",
             "--log-level", "warning", "--skip-server-warmup")
    try:
        for kill in (False, True):
            server = ServerProcess(*flags, env={"TMPDIR": str(tmp)})
            try:
                server.wait_healthy(180)
                [ipc] = tmp.glob("pdserve-ipc-*")
                assert sorted(p.name for p in ipc.iterdir()) == ["from_scheduler", "to_scheduler"]
                pgid = server.proc.pid
                if kill:
                    os.kill(pgid, signal.SIGKILL)  # the HTTP process only
                    server.proc.wait(10)
                else:
                    server.stop()
                assert not _wait_gone(pgid, timeout=20), "the scheduler outlived its server"
                assert not ipc.exists(), (
                    f"{'HTTP process killed' if kill else 'stopped'} (exit {server.proc.returncode}):"
                    f" left behind {sorted(p.name for p in ipc.iterdir())}\n{server.log()[-3000:]}")
            finally:
                server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_stopped_servers_log_is_read_back_and_its_file_removed(monkeypatch) -> None:
    """A test run leaves no server logs in the temp dir: stop() keeps the text (log() still
    answers, across a restart too) and removes the server's folder; PDCORE_KEEP_TEST_LOGS=1
    keeps it."""
    say = ("-c", "import sys; print('run', sys.argv[1:3], flush=True)")
    server = ServerProcess(command=say)
    server.proc.wait(60)
    server.stop()
    assert not server.tmp_dir.exists()
    assert "run ['--host', '127.0.0.1']" in server.log()
    server.start().proc.wait(60)
    server.stop()
    assert server.log().count("run ['--host', '127.0.0.1']") == 2 and not server.tmp_dir.exists()
    monkeypatch.setenv("PDCORE_KEEP_TEST_LOGS", "1")
    kept = ServerProcess(command=say)
    kept.proc.wait(60)
    kept.stop()
    try:
        assert "run ['--host', '127.0.0.1']" in kept.log_path.read_text()
    finally:
        shutil.rmtree(kept.tmp_dir)
