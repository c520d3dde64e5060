"""memfabric-hybrid's config store, started for real on loopback by `python -m pd_ascend.store`."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from ascend_helpers import (
    LineReader,
    clean_env,
    free_port,
    needs_memfabric,
    running_store,
    start_store,
    stop,
    wait_connectable,
)

pytestmark = needs_memfabric


def test_store_listens_on_loopback_and_stops_on_sigterm() -> None:
    with running_store() as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        assert wait_connectable(port), f"nothing accepts connections at {url}"
        with socket.socket() as s:  # a client the store accepts and keeps (it speaks first)
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
        assert proc.poll() is None, "the store exited after a client connected"
        assert stop(proc, timeout=20) == 0
    assert not wait_connectable(port, timeout=0.5), "the port still answers after the store left"


def test_second_store_on_a_taken_port_fails_with_memfabric_text() -> None:
    with running_store() as (url, _proc):
        other = start_store(url)
        try:
            rc = other.wait(timeout=60)
        finally:
            stop(other)
        err = other.stderr.read() if other.stderr else ""
    assert rc == 2
    assert f"memfabric create_config_store('{url}') returned -1" in err
    assert "address in use" in err, err[-1500:]


def test_url_from_environment() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "pd_ascend.store"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=clean_env(ASCEND_MF_STORE_URL=url))
    try:
        line = LineReader(proc).wait_for("listening", 30)
        assert line == f"memfabric config store listening on {url}\n"
    finally:
        stop(proc)


@pytest.mark.parametrize("args, env, needle", [
    ([], {}, "ASCEND_MF_STORE_URL is not set"),
    (["--url", "tcp://localhost:24669"], {}, "'localhost' is not an IP address"),
    (["--url", "127.0.0.1:24669"], {}, "--url='127.0.0.1:24669' is not of the form"),
    ([], {"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:0"}, "port must be a number in 1..65535"),
])
def test_bad_url_exits_2(args: list[str], env: dict[str, str], needle: str) -> None:
    out = subprocess.run([sys.executable, "-m", "pd_ascend.store", *args], check=False,
                         capture_output=True, text=True, timeout=60, env=clean_env(**env))
    assert out.returncode == 2, out
    assert needle in out.stderr
    assert out.stdout == ""
