"""The tools of the network fault bench (bench/netfaults.py, #49 item 4): the userspace fault
proxy (latency, loss as retransmission delays, broken connections, resets, refusals) on loopback, and the namespace
lab (a node reaches only its links' other ends, a cut drops the link's frames and heals, and
nothing named pdsf-<tag> is left after close), which needs root."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
from pdserve_testing import free_port

from pdcore.testing import netns
from pdcore.testing.fault_proxy import FaultProxy


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _echo(c: socket.socket) -> None:
    with c:
        try:
            while data := c.recv(65536):
                c.sendall(data)
        except OSError:
            pass


def _roundtrip(port: int, payload: bytes = b"x" * 100) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_fault_proxy_delays_breaks_resets_and_refuses() -> None:
    srv, target = _echo_server()
    proxy = FaultProxy("127.0.0.1", free_port(), "127.0.0.1", target, seed=1).start()
    port = proxy.listen[1]
    try:
        assert _roundtrip(port) == b"x" * 100
        proxy.latency_s = (0.05, 0.06)  # each way: a round trip takes >= 0.1 s
        t0 = time.monotonic()
        assert _roundtrip(port) == b"x" * 100
        assert time.monotonic() - t0 >= 0.1
        proxy.latency_s = (0.0, 0.0)
        proxy.loss, proxy.rto_s = 1.0, (0.1, 0.1)  # every chunk lost once: resent 0.1 s later
        t0 = time.monotonic()
        assert _roundtrip(port) == b"x" * 100
        assert time.monotonic() - t0 >= 0.2 and proxy.lost >= 2
        proxy.loss = 0.0
        proxy.break_p, proxy.break_after_bytes = 1.0, 50  # every connection broken in 50 bytes
        with pytest.raises(ConnectionError):
            got = _roundtrip(port, b"y" * 4096)
            raise ConnectionResetError(f"only {len(got)} bytes") if len(got) < 4096 else None
        proxy.break_p = 0.0
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:  # reset while open
            c.sendall(b"z")
            assert c.recv(1) == b"z"
            proxy.reset_all()
            with pytest.raises(ConnectionResetError):
                c.settimeout(10)
                c.sendall(b"z")
                if not c.recv(1):
                    raise ConnectionResetError("closed")
        proxy.refuse = True
        with pytest.raises(ConnectionError):
            if not _roundtrip(port):
                raise ConnectionResetError("closed")
        assert proxy.broken >= 3 and proxy.connections >= 5
    finally:
        proxy.stop()
        srv.close()


@pytest.mark.skipif(not netns.available()[0], reason=netns.available()[1])
def test_netlab_links_cuts_and_cleans_up() -> None:
    lab = netns.NetLab(["a", "b", "c"], [("a", "b"), ("b", "c")])
    server = None
    try:
        # a TCP echo in b, on b's host address; a reaches it, c's only link is to b
        code = (f"import socket;s=socket.socket();s.bind(('{lab.addr('b')}',9000));s.listen();"
                "[(c:=s.accept()[0]).sendall(c.recv(9)) for _ in range(9)]")
        server = subprocess.Popen(lab.exec_argv("b", [sys.executable, "-c", code]))
        results: dict[str, object] = {}

        def attempt(node: str, key: str, timeout: float = 2.0) -> None:
            lab.enter(node)  # this thread only
            try:
                with socket.create_connection((lab.addr("b"), 9000), timeout=timeout) as s:
                    s.sendall(b"ping")
                    results[key] = s.recv(9)
            except OSError as e:
                results[key] = e

        def run(node: str, key: str) -> object:
            t = threading.Thread(target=attempt, args=(node, key))
            t.start()
            t.join(30)
            return results[key]

        deadline = time.monotonic() + 10
        while run("a", "first") != b"ping":
            assert time.monotonic() < deadline, results
            time.sleep(0.1)
        assert run("c", "c") == b"ping"
        lab.cut("a", "b")
        assert isinstance(run("a", "cut"), OSError)  # dropped: times out (or no route)
        assert run("c", "c2") == b"ping"  # the other link is untouched
        lab.heal("a", "b")
        assert run("a", "healed") == b"ping"
        # the bench process itself is still in the root namespace
        assert socket.gethostbyname("localhost")
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        lab.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"pdsf-{lab.tag}" not in left + links
