"""Bounded connections (#30 item 3) on a real server and a real router on loopback: 2,000
sockets that never finish their headers (a slowloris, scaled down: bench/slowloris.py holds
20,000) leave `/health` answerable, the oldest waiting ones are evicted at the connection limit,
the header and body deadlines close what stalls, and nothing is logged per connection.

Before: uvicorn had no header deadline and no limit; 20,000 such sockets kept the router's
/health unreachable for the whole hold and logged 180,000 tracebacks."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcore.engine.model.tokenizer import default_model_file
from pdcore.testing.processes import ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

SOCKETS = 2000
LIMIT = 400  # connections per port in this test (the default is 4096)
HEADER_S = 3.0
# no per-peer limit here (one peer, loopback, makes the whole flood): this file holds the port's
# own limit; test_slow_bodies.py the per-peer one
ENV = {"PDSERVE_HTTP_MAX_CONNECTIONS": str(LIMIT), "PDSERVE_HTTP_HEADER_TIMEOUT_S": str(HEADER_S),
       "PDSERVE_HTTP_BODY_TIMEOUT_S": str(HEADER_S), "PDSERVE_HTTP_MAX_PENDING_PER_PEER": "100000"}

# the servers run with 1,024 file descriptors, so 2,000 sockets exhaust them as 20,000 did the
# router's 20,000 (where accept() then failed: EMFILE, a traceback a time)
NOFILE = 1024
pytestmark = pytest.mark.timeout(300)


def _limited(module: str, *args: str) -> tuple[str, ...]:
    """`python -m module args...` with RLIMIT_NOFILE at NOFILE (soft and hard)."""
    code = ("import resource, runpy, sys; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); "
            f"sys.argv = [{module!r}, *sys.argv[1:]]; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return ("-c", code, *args)


@pytest.fixture(scope="module")
def ports(tmp_path_factory) -> dict[str, ServerProcess]:
    model = make_tiny_model(str(tmp_path_factory.mktemp("m") / "m"), seed=3,
                            tokenizer_from=default_model_file())
    server = ServerProcess("--model-path", model, "--max-total-tokens", "2048", env=ENV,
                           command=_limited("pdcore", "serve"))
    server.wait_healthy(180)
    # the one server as both workers (two spellings of its address): the router is healthy
    router = ServerProcess(
        "--pd-disaggregation", "--prefill", server.url, "none",
        "--decode", server.url.replace("127.0.0.1", "localhost"),
        command=_limited("pdcore.router"), env=ENV)
    try:
        router.wait_healthy(60)
    except BaseException:
        server.stop()
        raise
    yield {"server": server, "router": router}
    router.stop()
    server.stop()


def _slow_sockets(port: int, n: int) -> list[socket.socket]:
    """n connections that send the start of a request and never finish its headers."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(True)
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ")
        except OSError:
            s.close()
            continue
        out.append(s)
    return out


def _metrics(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("pdserve_http_connections"):
            for s in fam.samples:
                out[(s.name, next(iter(s.labels.values()), ""))] = s.value
    return out


def _health_s(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


@pytest.mark.parametrize("who", ["router", "server"])
def test_health_answers_through_a_slowloris(ports, who) -> None:
    proc = ports[who]
    port = int(proc.url.rsplit(":", 1)[1])
    log_before = len(proc.log().splitlines())
    held = _slow_sockets(port, SOCKETS)
    try:
        assert len(held) > LIMIT, "the attack did not get its sockets connected"
        latencies = [_health_s(proc.url) for _ in range(10)]
        # the behaviour asked for is "within 1 s"; the bound leaves room for a loaded CI host
        assert max(latencies) < 3.0, latencies
        m = _metrics(proc.url)
        assert m[("pdserve_http_connections", "open")] <= LIMIT + 1, m
        assert m[("pdserve_http_connections_closed_total", "evicted")] >= SOCKETS - LIMIT - 50, m
        # the header deadline closes the rest (the sweep runs every second)
        deadline = time.monotonic() + HEADER_S + 10
        while _metrics(proc.url)[("pdserve_http_connections", "waiting_headers")] > 0:
            assert time.monotonic() < deadline, _metrics(proc.url)
            time.sleep(0.5)
        assert _metrics(proc.url)[("pdserve_http_connections_closed_total",
                                   "header_timeout")] > 0
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    new_lines = proc.log().splitlines()[log_before:]
    assert not [ln for ln in new_lines if "Traceback" in ln or "Invalid HTTP" in ln], new_lines[:20]
    assert len(new_lines) < 20, new_lines[:40]  # a summary line at most every 10 s, no flood


def test_a_stalled_body_is_closed(ports) -> None:
    proc = ports["server"]
    port = int(proc.url.rsplit(":", 1)[1])
    before = _metrics(proc.url).get(("pdserve_http_connections_closed_total", "body_timeout"), 0)
    s = socket.create_connection(("127.0.0.1", port), timeout=HEADER_S + 15)
    try:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"text\": \"")
        t0 = time.monotonic()
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        # a 408 that says why, then the close: the route never saw a whole body
        assert got.startswith(b"HTTP/1.1 408 ") and b"did not arrive in time" in got, got
        assert time.monotonic() - t0 < HEADER_S + 10
    finally:
        s.close()
    after = _metrics(proc.url)[("pdserve_http_connections_closed_total", "body_timeout")]
    assert after == before + 1
    assert _health_s(proc.url) < 3.0


def _kept_alive(port: int) -> socket.socket:
    """A connection that made one GET /health and keeps the connection open (HTTP/1.1)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    _get_health(s)
    return s


def _get_health(s: socket.socket) -> None:
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    got = b""

    def complete() -> bool:  # the headers and the content-length bytes of body after them
        head, sep, body = got.partition(b"\r\n\r\n")
        lengths = [ln.split(b":", 1)[1] for ln in head.lower().split(b"\r\n")
                   if ln.startswith(b"content-length:")]
        return bool(sep) and (not lengths or len(body) >= int(lengths[0]))

    while not complete():
        chunk = s.recv(4096)
        assert chunk, f"closed by the server after {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got


@pytest.mark.parametrize("who", ["router", "server"])
def test_an_idle_kept_alive_connection_outlives_uvicorns_5_s(ports, who) -> None:
    """A router's pooled connection idle for 7 s still carries the next request: uvicorn's
    default keep-alive (5 s) closed it first, racing the router's reuse (a failed attempt and a
    retry: behind sglang-router, two prefill requests for one prompt)."""
    s = _kept_alive(int(ports[who].url.rsplit(":", 1)[1]))
    try:
        time.sleep(7)
        _get_health(s)  # the same socket
    finally:
        s.close()


def test_idle_kept_alive_connections_are_evicted_at_the_limit(ports) -> None:
    """LIMIT connections that each made a request and then idle (kept alive, 120 s) do not lock
    the port: new connections evict the longest idle, and /health answers."""
    proc = ports["server"]
    port = int(proc.url.rsplit(":", 1)[1])
    before = _metrics(proc.url)[("pdserve_http_connections_closed_total", "evicted")]
    held = [_kept_alive(port) for _ in range(LIMIT)]
    try:
        for _ in range(5):
            _health_s(proc.url)
        m = _metrics(proc.url)
        assert m[("pdserve_http_connections", "open")] <= LIMIT + 1, m
        assert m[("pdserve_http_connections_closed_total", "evicted")] > before, m
        with pytest.raises(AssertionError, match="closed by the server"):
            _get_health(held[0])  # the longest idle went first
    finally:
        for s in held:
            s.close()
