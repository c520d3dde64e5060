"""The shared backend contract suite (pdcore.testing.backend_contract) run against the built-ins."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pdcore.builtin.fake_backend import FakeTransferEngine
from pdcore.errors import TransferError
from pdcore.interfaces.transfer import PENDING, PollResult
from pdcore.testing.backend_contract import BackendContract, CrossProcessBackendContract


class TestTcpContract(BackendContract):
    backend_name = "tcp"
    context_env: ClassVar[dict[str, str]] = {"PDCORE_TCP_TIMEOUT": "10"}
    dead_peer_timeout = 15.0


class TestTcpCrossProcess(CrossProcessBackendContract):
    backend_name = "tcp"
    context_env: ClassVar[dict[str, str]] = {"PDCORE_TCP_TIMEOUT": "10"}
    dead_peer_timeout = 15.0


class TestShmContract(BackendContract):
    backend_name = "shm"
    pool_name = "shm"
    dead_peer_timeout = 5.0


class TestShmCrossProcess(CrossProcessBackendContract):
    backend_name = "shm"
    pool_name = "shm"
    dead_peer_timeout = 5.0


class TestShmCmaContract(BackendContract):
    """cma mode: the receiver's KV in the thp pool (private memory), written with
    process_vm_writev into its pid (here the same process; the cross-process class below is the
    real case)."""

    backend_name = "shm"
    pool_name = "thp"
    dead_peer_timeout = 5.0


class TestShmCmaCrossProcess(CrossProcessBackendContract):
    backend_name = "shm"
    pool_name = "thp"
    dead_peer_timeout = 5.0


class TestFakeContract(BackendContract):
    backend_name = "fake"


class TestShmMemmoveCopyContract(BackendContract):
    """The shm backend with its ctypes.memmove copy strategy (the default is process_vm_writev
    where the sandbox permits it; TestShmContract covers that)."""

    backend_name = "shm"
    pool_name = "shm"
    dead_peer_timeout = 5.0
    context_env: ClassVar[dict[str, str]] = {"PDCORE_SHM_COPY": "memmove"}


class _RaisesOnUnknown(FakeTransferEngine):
    """Breaks the unknown-handle rule the way pd-mooncake and pd-nixl used to: it raises."""

    def poll(self, handle: int) -> PollResult:
        r = super().poll(handle)
        if "unknown handle" in r.reason:
            raise TransferError(r.reason)
        return r


class _PendingOnUnknown(FakeTransferEngine):
    """Breaks it the quiet way: an unknown handle looks like a transfer still running."""

    def poll(self, handle: int) -> PollResult:
        r = super().poll(handle)
        return PENDING if "unknown handle" in r.reason else r


@pytest.mark.parametrize("engine", [_RaisesOnUnknown, _PendingOnUnknown])
def test_contract_catches_a_backend_that_breaks_the_unknown_handle_rule(engine: type) -> None:
    suite = type("Suite", (BackendContract,), {
        "engine_factory": f"{engine.__module__}:{engine.__name__}", "timeout": 0.5})()
    with suite.open_pair() as pair, pytest.raises((AssertionError, TransferError)):
        suite.test_unknown_handle_is_failed(pair)
