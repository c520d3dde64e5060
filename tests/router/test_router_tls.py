"""The router over TLS (#45 item 12), sglang-router's flags: it serves HTTPS with
--tls-cert-path/--tls-key-path, and its calls to https:// workers verify their certificates
against --ca-cert-paths (a CA made here with the openssl CLI; workers: the fake prefill and
decode apps on real uvicorn HTTPS servers)."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fake_workers import FakeWorker

from pdcore.testing.tls import make_pki

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


class TLSServerThread:
    """uvicorn serving `app` over HTTPS in a daemon thread (what ServerThread is for HTTP)."""

    def __init__(self, app, cert: Path, key: Path) -> None:  # type: ignore[no-untyped-def]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", ssl_certfile=str(cert), ssl_keyfile=str(key)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _router(*flags: str, log: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "pdcore.router", "--port", str(port),
                             "--policy", "round_robin", *flags], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, port


def test_router_serves_https_and_verifies_https_workers(tmp_path: Path) -> None:
    ca, cert, key = make_pki(tmp_path)
    verify = ssl.create_default_context(cafile=str(ca))
    p, d = FakeWorker("prefill", "p0"), FakeWorker("decode", "d0")
    servers = [TLSServerThread(w.app(), cert, key) for w in (p, d)]
    workers = ["--pd-disaggregation", "--prefill", servers[0].url, "none",
               "--decode", servers[1].url]
    procs = []
    try:
        good, port = _router(*workers, "--tls-cert-path", str(cert), "--tls-key-path",
                             str(key), "--ca-cert-paths", str(ca), log=tmp_path / "good.log")
        procs.append(good)
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # healthy once its health checks reached both workers over TLS
            assert good.poll() is None, (tmp_path / "good.log").read_text()
            try:
                if httpx.get(url + "/readiness", verify=verify, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "good.log").read_text()
            time.sleep(0.2)
        r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {
            "max_new_tokens": 2}}, verify=verify, timeout=30)
        assert r.status_code == 200, r.text
        assert len(p.wait_received(1)) == 1 and len(d.bodies("/generate")) == 1
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", timeout=10)  # the router's certificate: the test CA's
        # without --ca-cert-paths the router trusts the system's CAs only: the workers'
        # certificates fail verification and nothing reaches them
        bare, port2 = _router(*workers, "--mini-lb", log=tmp_path / "bare.log")
        procs.append(bare)
        url2 = f"http://127.0.0.1:{port2}"
        deadline = time.monotonic() + 60
        while True:
            assert bare.poll() is None, (tmp_path / "bare.log").read_text()
            try:
                httpx.get(url2 + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        r = httpx.post(url2 + "/generate", json={"text": "hi"}, timeout=30)
        assert r.status_code >= 500, r.text
        assert len(p.received) == 1 and len(d.bodies("/generate")) == 1  # no new request
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        for s in servers:
            s.stop()
