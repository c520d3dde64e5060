"""tcp backend: the receiver's bounds checks, dead and frozen peers, handshake, lifecycle."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from pdcore.builtin import tcp_wire as wire
from pdcore.builtin.tcp_backend import TcpTransferEngine
from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.transfer import (
    BackendContext,
    CopyBatch,
    MemoryRegion,
    TransferStatus,
)
from pdcore.testing.remote import ReceiverSpec, RemoteReceiver, sentinel

REGION = 1 << 20


def region_of(a: np.ndarray) -> MemoryRegion:
    return MemoryRegion(a.ctypes.data, a.nbytes, name="test")


def batch(src: list[int], dst: list[int], length: list[int]) -> CopyBatch:
    u = np.uint64
    return CopyBatch(np.array(src, dtype=u), np.array(dst, dtype=u), np.array(length, dtype=u))


def engine(timeout: float = 10.0) -> TcpTransferEngine:
    return TcpTransferEngine(BackendContext(env={"PDCORE_TCP_TIMEOUT": str(timeout)}))


@pytest.fixture
def sender():
    e = engine(timeout=2.0)
    src = np.random.default_rng(0).integers(0, 256, 4 * REGION, dtype=np.uint8)
    e.register([region_of(src)])
    yield e, src
    e.close()


@pytest.fixture
def remote():
    spec = ReceiverSpec("tcp", "", "torch", "cpu", REGION, 2, seed=3,
                        env={"PDCORE_TCP_TIMEOUT": "2"})
    with RemoteReceiver(spec) as r:
        yield r


def test_bytes_arrive_across_processes(sender, remote) -> None:
    eng, src = sender
    peer = eng.connect(remote.endpoint, remote.regions)
    r0, r1 = remote.regions
    base = src.ctypes.data
    b = batch([base + 5, base + 70000, base + 3 * REGION],
              [r0.addr + 1, r1.addr + 4096, r1.addr + REGION - 3000], [12288, 65536, 3000])
    assert eng.wait(eng.write(peer, b), 20).status is TransferStatus.DONE
    got0, got1 = remote.read(0), remote.read(1)
    exp0, exp1 = sentinel(3, 0, REGION), sentinel(3, 1, REGION)
    exp0[1:12289] = src[5:12293]
    exp1[4096:4096 + 65536] = src[70000:70000 + 65536]
    exp1[REGION - 3000:] = src[3 * REGION:3 * REGION + 3000]
    assert np.array_equal(got0, exp0) and np.array_equal(got1, exp1)


def test_receiver_rejects_out_of_range_and_writes_nothing(sender, remote) -> None:
    """A lying sender (its view of the peer's regions is too big) still cannot write outside:
    the receiver checks every range first, so even the valid items are not written."""
    eng, src = sender
    r0, r1 = remote.regions
    lie = [MemoryRegion(r.addr, r.length + (1 << 30)) for r in remote.regions]
    peer = eng.connect(remote.endpoint, lie)
    base = src.ctypes.data
    b = batch([base, base + 4096, base + 8192],
              [r0.addr, r1.addr + 100, r0.end], [4096, 4096, 16])  # last: just past region 0
    res = eng.wait(eng.write(peer, b), 20)
    assert res.status is TransferStatus.FAILED
    assert "outside its registered memory" in res.reason and "item 2" in res.reason
    assert np.array_equal(remote.read(0), sentinel(3, 0, REGION))
    assert np.array_equal(remote.read(1), sentinel(3, 1, REGION))
    # the connection stayed in step: a good batch on the same peer still works
    ok = eng.wait(eng.write(peer, batch([base], [r0.addr], [64])), 20)
    assert ok.status is TransferStatus.DONE
    assert np.array_equal(remote.read(0)[:64], src[:64])


def test_sender_side_check_fails_early(sender, remote) -> None:
    eng, src = sender
    peer = eng.connect(remote.endpoint, remote.regions)
    r0 = remote.regions[0]
    res = eng.poll(eng.write(peer, batch([src.ctypes.data], [r0.end - 8], [16])))
    assert res.status is TransferStatus.FAILED and "nothing was sent" in res.reason
    res = eng.poll(eng.write(peer, batch([src.ctypes.data + 4 * REGION], [r0.addr], [1])))
    assert res.status is TransferStatus.FAILED and "register() it first" in res.reason


def test_killed_peer_fails_fast(sender, remote) -> None:
    eng, src = sender
    peer = eng.connect(remote.endpoint, remote.regions)
    r0 = remote.regions[0]
    first = eng.wait(eng.write(peer, batch([src.ctypes.data], [r0.addr], [64])), 20)
    assert first.status is TransferStatus.DONE  # a pooled connection is open when it dies
    remote.kill()
    t0 = time.monotonic()
    res = eng.wait(eng.write(peer, batch([src.ctypes.data], [r0.addr], [REGION])), 10)
    assert res.status is TransferStatus.FAILED
    assert time.monotonic() - t0 < 5
    assert "127.0.0.1" in res.reason and "timed out" not in res.reason


def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: kill() only queues the
    signal, and on a loaded machine a receiver thread can still finish a batch meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout}s of SIGSTOP")


def test_frozen_peer_times_out(sender, remote) -> None:
    eng, src = sender  # PDCORE_TCP_TIMEOUT=2
    peer = eng.connect(remote.endpoint, remote.regions)
    r0, r1 = remote.regions
    freeze(remote.proc.pid)
    try:
        t0 = time.monotonic()
        b = batch([src.ctypes.data, src.ctypes.data], [r0.addr, r1.addr], [REGION, REGION])
        res = eng.wait(eng.write(peer, b), 15)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(remote.proc.pid, signal.SIGCONT)
    assert res.status is TransferStatus.FAILED, res
    assert "did not finish the batch within 2.0s" in res.reason, res.reason
    assert "PDCORE_TCP_TIMEOUT" in res.reason
    assert 1.5 < elapsed < 10, elapsed  # bounded by the 2 s timeout (+ a loaded machine)


def test_connect_errors_are_clear() -> None:
    e = engine()
    try:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ep = f'{{"host": "127.0.0.1", "port": {port}, "token": "{"00" * 16}"}}'.encode()
        with pytest.raises(TransferError, match=f"cannot connect to peer 127.0.0.1:{port}"):
            e.connect(ep, [])
        with pytest.raises(TransferError, match="malformed peer endpoint"):
            e.connect(b"not json", [])
        other = engine()
        try:
            wrong = other.endpoint().replace(other._token.hex().encode(), b"11" * 16)
            with pytest.raises(TransferError, match="wrong data-plane token"):
                e.connect(wrong, [])
        finally:
            other.close()
    finally:
        e.close()


def test_raw_hostile_header_is_refused() -> None:
    """A peer speaking the wire format directly gets an error ack; nothing is written."""
    dst = np.zeros(8192, dtype=np.uint8)
    e = engine()
    try:
        e.register([region_of(dst)])
        info = __import__("json").loads(e.endpoint())
        with socket.create_connection((info["host"], info["port"]), timeout=5) as s:
            s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, bytes.fromhex(info["token"])))
            assert wire.recv_exact(s, 4, None) == wire.HELLO_OK
            items = np.array([dst.ctypes.data + 8000, 400], dtype="<u8")  # 8000 + 400 > 8192
            s.sendall(wire.BATCH.pack(wire.BATCH_MAGIC, wire.VERSION, 0, 7, 1, 400)
                      + items.tobytes() + b"\xff" * 400)
            magic, handle, status, n = wire.ACK.unpack(wire.recv_exact(s, wire.ACK.size, None))
            reason = wire.recv_exact(s, n, None).decode()
        assert (magic, handle, status) == (wire.ACK_MAGIC, 7, 1)
        assert "outside its registered memory" in reason
        assert not dst.any()
    finally:
        e.close()


def test_timeout_setting_is_validated() -> None:
    with pytest.raises(ConfigError, match="PDCORE_TCP_TIMEOUT"):
        TcpTransferEngine(BackendContext(env={"PDCORE_TCP_TIMEOUT": "soon"}))
    with pytest.raises(ConfigError, match="PDCORE_TCP_TIMEOUT"):
        TcpTransferEngine(BackendContext(env={"PDCORE_TCP_TIMEOUT": "0"}))
    assert engine(timeout=3.5).timeout == 3.5


def test_close_stops_threads_and_refuses_work() -> None:
    before = {t.ident for t in threading.enumerate()}
    a, b = engine(), engine()
    src, dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    a.register([region_of(src)])
    b.register([region_of(dst)])
    peer = a.connect(b.endpoint(), [region_of(dst)])
    assert a.wait(a.write(peer, batch([src.ctypes.data], [dst.ctypes.data], [4096]))).status \
        is TransferStatus.DONE
    assert dst.all()
    for e in (a, b, a, b):
        e.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, f"threads left running after close(): {[t.name for t in extra]}"
    with pytest.raises(TransferError, match="closed"):
        a.write(peer, CopyBatch.empty())
