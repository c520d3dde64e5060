"""Connection floods against the listening sockets of one PD pair, in process: the tcp data
receiver, P's bootstrap HTTP server and the zmq control plane. A flood of idle connections
(no handshake, no request) must not keep a real peer out, and must not stay open for ever."""

from __future__ import annotations

import http.client
import socket
import time

import numpy as np

from pdcore.builtin.tcp_backend import TcpTransferEngine
from pdcore.disagg import wire
from pdcore.disagg.bootstrap import BootstrapClient, BootstrapServer
from pdcore.disagg.control import ControlPlane
from pdcore.interfaces.transfer import BackendContext, CopyBatch, MemoryRegion, TransferStatus
from pdcore.netguard import MAX_PENDING_PER_SOURCE, PENDING_DEADLINE_S, ConnectionGate

FLOOD = 500


def _flood(port: int, n: int = FLOOD) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(s)
    return socks


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """True when the server closes s within timeout (whatever greeting it sent first)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            if s.recv(4096) == b"":
                return True
        except ConnectionResetError:
            return True
        except (TimeoutError, OSError):
            return False
    return False


def _region(a: np.ndarray) -> MemoryRegion:
    return MemoryRegion(a.ctypes.data, a.nbytes, name="flood")


def test_gate_evicts_the_oldest_pending_of_a_source() -> None:
    gate = ConnectionGate("unit", max_pending=1000, max_per_source=3)
    pairs = [socket.socketpair() for _ in range(5)]
    try:
        for a, _ in pairs:
            gate.admit(a, "10.0.0.1")
        assert gate.pending() == 3 and gate.evicted == 2
        assert _closed_by_peer(pairs[0][1], 1) and _closed_by_peer(pairs[1][1], 1)
        assert gate.promote(pairs[4][0]) and not gate.promote(pairs[0][0])
        gate.admit(pairs[0][0], "10.0.0.2")  # another source has its own allowance
        assert gate.pending() == 3
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_tcp_receiver_serves_a_real_peer_through_an_idle_flood() -> None:
    recv = TcpTransferEngine(BackendContext(env={"PDCORE_TCP_TIMEOUT": "10"}))
    send = TcpTransferEngine(BackendContext(env={"PDCORE_TCP_TIMEOUT": "10"}))
    dst = np.zeros(1 << 16, dtype=np.uint8)
    src = np.arange(1 << 16, dtype=np.uint32).astype(np.uint8)
    recv.register([_region(dst)])
    send.register([_region(src)])
    port = recv._receiver.port
    flood = _flood(port)
    try:
        # the whole flood is pending (never established), and bounded per source
        deadline = time.monotonic() + 10
        while recv._receiver.gate.evicted < FLOOD - MAX_PENDING_PER_SOURCE:
            assert time.monotonic() < deadline, "the receiver did not bound the flood"
            time.sleep(0.05)
        peer = send.connect(recv.endpoint(), [_region(dst)])
        u = np.uint64
        h = send.write(peer, CopyBatch(np.array([src.ctypes.data], dtype=u),
                                       np.array([dst.ctypes.data], dtype=u),
                                       np.array([src.nbytes], dtype=u)))
        assert send.wait(h, 10).status is TransferStatus.DONE
        np.testing.assert_array_equal(dst, src)
        # the survivors of the flood are closed at their handshake deadline
        assert _closed_by_peer(flood[-1], PENDING_DEADLINE_S + 10)
    finally:
        for s in flood:
            s.close()
        send.close()
        recv.close()


def test_bootstrap_server_answers_through_an_idle_flood() -> None:
    srv = BootstrapServer("127.0.0.1", 0, route_secret="s")
    srv.start()
    addr = f"127.0.0.1:{srv.port}"
    flood = _flood(srv.port)
    try:
        client = BootstrapClient(connect_timeout=5, read_timeout=5, route_secret="s")
        client.put_route(addr, {"rank_ip": "127.0.0.1", "rank_port": 5000, "tp_rank": 0,
                                "tp_size": 1, "page_size": 4, "kv_cache_dtype": "float32"})
        assert client.health(addr) == srv.instance_id
        assert client.get_rank(addr, 0, 0, instance=srv.instance_id) == ("127.0.0.1", 5000)
        assert _closed_by_peer(flood[-1], PENDING_DEADLINE_S + 10)
    finally:
        for s in flood:
            s.close()
        srv.close()


def test_bootstrap_refuses_huge_bodies_and_unknown_writers() -> None:
    srv = BootstrapServer("127.0.0.1", 0, route_secret="s")
    srv.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        conn.request("PUT", "/route", body=b"{}", headers={"X-PD-Route-Secret": "guess"})
        assert conn.getresponse().status == 403
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        conn.putrequest("PUT", "/route")
        conn.putheader("X-PD-Route-Secret", "s")
        conn.putheader("Content-Length", str(1 << 30))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and b"Content-Length" in resp.read()
        conn.close()
    finally:
        srv.close()


def test_zmq_control_plane_receives_through_an_idle_flood() -> None:
    got: list[wire.Message] = []
    plane = ControlPlane("127.0.0.1", None, "flood", got.append, lambda: None)
    addr = plane.start()
    sender = ControlPlane("127.0.0.1", None, "sender", lambda m: None, lambda: None)
    sender.start()
    flood = _flood(int(addr.rpartition(":")[2]))
    try:
        assert sender.send(addr, wire.AbortAck(room=7, rank=0))
        deadline = time.monotonic() + 10
        while not got:
            assert time.monotonic() < deadline, "the control message did not arrive"
            time.sleep(0.05)
        assert isinstance(got[0], wire.AbortAck) and got[0].room == 7
        # zmq drops connections that never greet (handshake interval)
        assert _closed_by_peer(flood[-1], PENDING_DEADLINE_S + 10)
    finally:
        for s in flood:
            s.close()
        sender.close()
        plane.close()
