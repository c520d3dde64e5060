"""Backend `ascend` over the real memfabric-hybrid library.

On a machine without the Ascend driver memfabric refuses to start its transfer engine (every
mode, host memory included: its driver check runs first). These tests pin down that our backend
reports that refusal cleanly, with memfabric's own words, and that the data path reports a
failed write as FAILED with memfabric's text. Where the driver is present they are skipped:
the NPU tests (test_contract.py) then exercise the real thing.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest
from ascend_helpers import needs_memfabric
from pd_ascend.plugin import create_backend
from pd_ascend.settings import ascend_driver_file

from pdcore.errors import ConfigError, TransferError, UnavailableError
from pdcore.interfaces.transfer import (
    BackendContext,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    TransferStatus,
)
from pdcore.plugins.host import transfer_backends

pytestmark = needs_memfabric
DRIVER_REFUSAL = "the current version of ascend driver does not support mf!"
no_driver = pytest.mark.skipif(ascend_driver_file() is not None,
                               reason="the Ascend driver is installed: memfabric starts here")


def ctx(url: str, role: str = "prefill", **env: str) -> BackendContext:
    return BackendContext(role=role, host="127.0.0.1", env={"ASCEND_MF_STORE_URL": url, **env})


@no_driver
@pytest.mark.parametrize("protocol", ["sdma", "device_rdma"])
def test_initialize_refusal_carries_memfabric_text(mf_store: str, protocol: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TransferError) as e:
        create_backend(ctx(mf_store, ASCEND_MF_TRANSFER_PROTOCOL=protocol))
    msg = str(e.value)
    assert time.monotonic() - t0 < 10
    assert msg.startswith(f"memfabric TransferEngine.initialize(store {mf_store}, session "
                          f"127.0.0.1:0, role Prefill, device 0, {protocol}) returned -1: ")
    assert DRIVER_REFUSAL in msg
    assert "hybm core init failed" in msg


@no_driver
def test_registry_reports_the_backend_unavailable_with_the_reason() -> None:
    ok, reason = transfer_backends().get("ascend").available()
    assert not ok and "needs the Ascend NPU driver" in reason
    with pytest.raises(UnavailableError, match="needs the Ascend NPU driver"):
        transfer_backends().create("ascend", ctx("tcp://127.0.0.1:1"))


@pytest.mark.parametrize("context, needle", [
    (BackendContext(role="prefill", host="127.0.0.1"), "ASCEND_MF_STORE_URL is not set"),
    (BackendContext(role="null", host="127.0.0.1",
                    env={"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:1"}), "--disaggregation-mode"),
    (BackendContext(role="decode", host="127.0.0.1",
                    env={"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:1",
                         "ASCEND_MF_TRANSFER_PROTOCOL": "roce"}), "'roce' is not supported"),
    (BackendContext(role="decode", host="0.0.0.0",
                    env={"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:1"}), "pass --host"),
])
def test_configuration_errors_come_before_memfabric(context: BackendContext, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        create_backend(context)


@pytest.fixture
def data_path():
    """Our data path over a real memfabric TransferEngine that was never initialized (the only
    state of it this machine allows): every transfer call fails inside memfabric."""
    import memfabric_hybrid as mf
    from pd_ascend.memfabric_engine import MemfabricDataPath

    dp = MemfabricDataPath(mf.TransferEngine(), threads=2)
    yield dp
    dp.jobs.close()
    dp.mf.destroy()


def _wait(dp, handle: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (r := dp.jobs.poll(handle)).status is TransferStatus.PENDING:
        assert time.monotonic() < deadline, "write stayed PENDING"
        time.sleep(0.005)
    return r


def test_failed_write_is_failed_with_memfabric_text(data_path) -> None:
    src, dst = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(4096)
    batch = CopyBatch(np.array([ctypes.addressof(src)], dtype=np.uint64),
                      np.array([ctypes.addressof(dst)], dtype=np.uint64),
                      np.array([64], dtype=np.uint64))
    r = _wait(data_path, data_path.write("127.0.0.1:1", batch))
    assert r.status is TransferStatus.FAILED
    assert r.reason == ("memfabric batch_transfer_sync_write of 1 copies to 127.0.0.1:1 returned "
                        "-1: smem trans not initialized yet")
    assert dst.raw == b"\0" * 4096  # nothing landed
    assert data_path.jobs.poll(1).status is TransferStatus.FAILED  # released after reporting


def test_writes_in_flight_each_report(data_path) -> None:
    src = ctypes.create_string_buffer(1 << 16)
    base = ctypes.addressof(src)
    batches = [CopyBatch(np.array([base + i], dtype=np.uint64), np.array([base], dtype=np.uint64),
                         np.array([8], dtype=np.uint64)) for i in range(8)]
    handles = [data_path.write("127.0.0.1:1", b) for b in batches]
    assert len(set(handles)) == 8
    assert all(_wait(data_path, h).status is TransferStatus.FAILED for h in handles)


def test_zero_length_batch_is_done_without_calling_memfabric(data_path) -> None:
    assert _wait(data_path, data_path.write("127.0.0.1:1", CopyBatch.empty())).status \
        is TransferStatus.DONE


def test_register_refuses_memory_it_cannot_reach(data_path) -> None:
    kinds = frozenset({MemoryKind.NPU, MemoryKind.HOST})
    with pytest.raises(TransferError, match="cannot register cuda memory"):
        data_path.register([MemoryRegion(1 << 20, 4096, MemoryKind.CUDA)], kinds)
    with pytest.raises(TransferError, match="has length 0"):
        data_path.register([MemoryRegion(1 << 20, 0, MemoryKind.HOST)], kinds)
    assert data_path.registered == {}


def test_peer_endpoint_validation() -> None:
    from pd_ascend.memfabric_engine import parse_session

    assert parse_session(b"10.0.0.2:4242") == "10.0.0.2:4242"
    for bad in (b"10.0.0.2", b"10.0.0.2:0", b"10.0.0.2:port", b"\xff:1", b":80"):
        with pytest.raises(TransferError, match="is not 'ip:port'"):
            parse_session(bad)


def test_captured_log_is_replayed_and_thread_filtered(capfd) -> None:
    """The stdout capture hands memfabric's lines back to stdout and keeps only this thread's
    ERROR lines as the reason."""
    import memfabric_hybrid as mf
    from pd_ascend import mf_log

    with mf_log.captured_stdout() as out:
        rc = mf.create_config_store("tcp://localhost:1")  # memfabric refuses host names
        os.write(1, b"another writer of fd 1\n")
    assert rc != 0
    replayed = capfd.readouterr().out
    assert "CreateParser failed, url: tcp://localhost:1" in replayed
    assert "another writer of fd 1" in replayed and "another writer of fd 1" in out.text
    mine = mf_log.errors(out.text, threading.get_native_id())
    assert any("input store URL invalid" in m for m in mine)
    assert mf_log.errors(out.text, tid=1) == []
