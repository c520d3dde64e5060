"""pd-nixl engine behaviour against real NIXL (UCX over lo; LIBFABRIC where it loads)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="nixl not installed")

from pd_nixl.engine import NixlEngine

from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.transfer import (
    BackendContext,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    TransferStatus,
)
from pdcore.testing.remote import ReceiverSpec, RemoteReceiver


def engine(env: dict[str, str] | None = None) -> NixlEngine:
    return NixlEngine(BackendContext(env=env or {}))


def region(buf: np.ndarray, kind: MemoryKind = MemoryKind.HOST) -> MemoryRegion:
    return MemoryRegion(addr=buf.ctypes.data, length=buf.nbytes, kind=kind)


def one_copy(src: int, dst: int, n: int) -> CopyBatch:
    return CopyBatch(np.array([src], np.uint64), np.array([dst], np.uint64), np.array([n], np.uint64))


@pytest.fixture
def pair() -> Iterator[tuple[NixlEngine, NixlEngine]]:
    a, b = engine(), engine()
    yield a, b
    a.close()
    b.close()


def installed_plugins() -> list[str]:
    from nixl._api import nixl_agent, nixl_agent_config

    return list(nixl_agent("pd-nixl-test-probe", nixl_agent_config(backends=[])).get_plugin_list())


def test_unknown_plugin_lists_what_nixl_reports() -> None:
    with pytest.raises(ConfigError) as info:
        engine({"SGLANG_DISAGGREGATION_NIXL_BACKEND": "NOPE"})
    listed = str(info.value).split("available: ")[1].split(", ")
    assert sorted(listed) == sorted(installed_plugins())
    assert "UCX" in listed


def test_backend_params_reach_nixl() -> None:
    e = engine({"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": '{"num_workers": 2}'})
    try:
        assert e._agent.get_backend_params("UCX")["num_workers"] == "2"
    finally:
        e.close()
    with pytest.raises(ConfigError, match="NIXL could not create its UCX backend .*NIXL_ERR_BACKEND"):
        engine({"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": '{"ucx_error_handling_mode": "x"}'})


def test_progress_pump_thread_lifecycle() -> None:
    e = engine()
    assert [t for t in threading.enumerate() if t.name.startswith("pd-nixl-pump")]
    e.close()
    e.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("pd-nixl-pump")]
    with pytest.raises(TransferError, match="closed"):
        e.endpoint()
    t = engine({"PDCORE_NIXL_PROGRESS": "thread"})
    try:
        assert not [x for x in threading.enumerate() if x.name.startswith("pd-nixl-pump")]
    finally:
        t.close()


def test_writes_and_failures_carry_nixl_reasons(pair: tuple[NixlEngine, NixlEngine]) -> None:
    a, b = pair
    assert a.capabilities.needs_metadata and MemoryKind.HOST in a.capabilities.memory_kinds
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    a.register([region(src)])
    b.register([region(dst)])
    peer = a.connect(b.endpoint(), [region(dst)])
    assert peer.key == b.agent_name
    r = a.wait(a.write(peer, one_copy(src.ctypes.data + 5, dst.ctypes.data + 100, 1000)), 10)
    assert r.status is TransferStatus.DONE, r.reason
    assert np.array_equal(dst[100:1100], src[5:1005]) and not dst[:100].any()
    r = a.wait(a.write(peer, one_copy(src.ctypes.data, dst.ctypes.data + dst.nbytes - 10, 100)), 10)
    assert r.status is TransferStatus.FAILED and "NIXL_ERR_NOT_FOUND" in r.reason
    assert b.agent_name in r.reason and "outside the registered memory" in r.reason
    r = a.poll(12345)  # the transfer contract: an unknown handle is FAILED, naming it
    assert r.status is TransferStatus.FAILED and "unknown handle 12345" in r.reason


def test_connect_checks_metadata_and_regions(pair: tuple[NixlEngine, NixlEngine]) -> None:
    a, b = pair
    dst = np.zeros(4096, dtype=np.uint8)
    later = np.zeros(4096, dtype=np.uint8)
    b.register([region(dst)])
    stale = b.endpoint()
    with pytest.raises(TransferError, match="does not expose the DRAM regions"):
        a.connect(stale, [region(later)])  # a region the metadata does not list
    b.register([region(later)])
    peer = a.connect(b.endpoint(), [region(dst), region(later)])  # fresh metadata replaces it
    src = np.full(4096, 7, dtype=np.uint8)
    a.register([region(src)])
    assert a.wait(a.write(peer, one_copy(src.ctypes.data, later.ctypes.data, 4096)), 10).status \
        is TransferStatus.DONE
    assert (later == 7).all()
    with pytest.raises(TransferError, match="not NIXL agent metadata"):
        a.connect(b"not metadata", [])
    with pytest.raises(TransferError, match="cannot register npu memory"):
        a.register([region(np.zeros(64, dtype=np.uint8), MemoryKind.NPU)])


def test_dead_peer_metadata_is_refused_fast() -> None:
    a, b = engine(), engine()
    try:
        endpoint = b.endpoint()
        b.close()
        with pytest.raises(TransferError, match="cannot load the peer's agent metadata"):
            a.connect(endpoint, [])
    finally:
        a.close()


def test_killed_peer_reports_remote_disconnect() -> None:
    spec = ReceiverSpec("nixl", "", "torch", "cpu", 1 << 20, 1, seed=3)
    a = engine()
    src = np.ones(1 << 20, dtype=np.uint8)
    a.register([region(src)])
    try:
        with RemoteReceiver(spec) as remote:
            peer = a.connect(remote.endpoint, remote.regions)
            dst = remote.regions[0].addr
            assert a.wait(a.write(peer, one_copy(src.ctypes.data, dst, 4096)), 20).status \
                is TransferStatus.DONE
            remote.kill()
            r = a.wait(a.write(peer, one_copy(src.ctypes.data, dst, 1 << 20)), 15)
            assert r.status is TransferStatus.FAILED
            assert "NIXL_ERR_REMOTE_DISCONNECT" in r.reason and "peer disconnected" in r.reason
            a.disconnect(peer)
    finally:
        a.close()


# -- LIBFABRIC: the same code path, selected by the environment ----------------------------

LIBFABRIC = {"SGLANG_DISAGGREGATION_NIXL_BACKEND": "LIBFABRIC"}


def libfabric_problem() -> str | None:
    """None when a LIBFABRIC engine can be created here, else NIXL's reason."""
    try:
        engine(LIBFABRIC).close()
    except ConfigError as e:
        return str(e)
    return None


NIXL_OWN_LOG = textwrap.dedent("""
    import os
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("libfabric-probe", nixl_agent_config(backends=[]))
    try:
        agent.create_backend("LIBFABRIC", {})
        print("CREATED")
    except Exception as e:
        print("RAISED", type(e).__name__, e)
    os._exit(0)
""")


def test_libfabric_skip_reason_is_what_nixl_itself_logs() -> None:
    """Our reason quotes the loader message NIXL logs at debug level, word for word."""
    problem = libfabric_problem()
    if problem is None:
        pytest.skip("LIBFABRIC loads on this machine: nothing to explain")
    env = {**__import__("os").environ, "NIXL_LOG_LEVEL": "DEBUG"}
    proc = subprocess.run([sys.executable, "-c", NIXL_OWN_LOG], capture_output=True, text=True, check=False,
                          timeout=60, env=env)
    assert "RAISED" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    code = proc.stdout.split("RAISED", 1)[1].split()[1]
    assert code in problem  # the same NIXL status code, e.g. NIXL_ERR_NOT_FOUND
    logged = re.search(r"Failed to load plugin from (\S+): (.+)$", proc.stderr, re.MULTILINE)
    assert logged or "does not load" not in problem, proc.stderr[-2000:]
    if logged:
        path, loader_message = logged.group(1), logged.group(2).strip()
        assert loader_message in problem
        assert __import__("os").path.realpath(path).endswith("libplugin_LIBFABRIC.so")


class TestLibfabricWhereItLoads:
    """The transfer tests for LIBFABRIC; they skip with NIXL's reason where it cannot load."""

    @pytest.fixture(autouse=True)
    def _libfabric(self) -> None:
        problem = libfabric_problem()
        if problem:
            pytest.skip(f"LIBFABRIC unavailable here: {problem}")

    def test_write(self) -> None:
        a, b = engine(LIBFABRIC), engine(LIBFABRIC)
        try:
            assert a.backend == "LIBFABRIC"
            src = np.arange(1 << 16, dtype=np.uint8)
            dst = np.zeros(1 << 16, dtype=np.uint8)
            a.register([region(src)])
            b.register([region(dst)])
            peer = a.connect(b.endpoint(), [region(dst)])
            r = a.wait(a.write(peer, one_copy(src.ctypes.data, dst.ctypes.data, 1 << 16)), 30)
            assert r.status is TransferStatus.DONE, r.reason
            assert np.array_equal(src, dst)
        finally:
            a.close()
            b.close()
