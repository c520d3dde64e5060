"""Helpers for the pd-ascend tests (a uniquely named module: the test folders of several
plugins may be collected together): free loopback ports and a real memfabric config store
running in a child process (`python -m pd_ascend.store`). Only 127.0.0.1 is ever used."""

from __future__ import annotations

import importlib.util
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pdcore.testing.processes import free_port

HAS_MEMFABRIC = importlib.util.find_spec("memfabric_hybrid") is not None
needs_memfabric = pytest.mark.skipif(not HAS_MEMFABRIC,
                                     reason="memfabric-hybrid not installed (pip install "
                                            "memfabric-hybrid)")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without the Ascend switches a developer may have exported, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASCEND_MF_", "MF_CONFIG_STORE", "ENABLE_ASCEND_TRANSFER",
                                "ASCEND_NPU_PHY_ID"))}
    env.update(extra)
    return env


class LineReader:
    """Reads a child's stdout on a thread (select() cannot see lines already buffered)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(proc,), daemon=True)
        self._thread.start()

    def _run(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # EOF

    def wait_for(self, needle: str, timeout: float) -> str:
        """The first line containing `needle` ('' on timeout or EOF). memfabric prints its own
        log lines to stdout too."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return ""
            if not line:
                return ""
            if needle in line:
                return line
        return ""


def stop(proc: subprocess.Popen[str], timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return int(proc.returncode)


def start_store(url: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pd_ascend.store", "--url", url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or clean_env())


@contextmanager
def running_store(timeout: float = 30.0) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A memfabric config store on 127.0.0.1:<free port>; yields (url, process)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    proc = start_store(url)
    try:
        line = LineReader(proc).wait_for("listening", timeout)
        if not line:
            stop(proc)
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"config store did not start: {line!r} {err[-2000:]}")
        yield url, proc
    finally:
        stop(proc)


def wait_connectable(port: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False
