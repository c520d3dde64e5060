"""The shared backend contract suite (pdcore.testing.backend_contract) run against the built-ins."""

from __future__ import annotations

from typing import ClassVar

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
