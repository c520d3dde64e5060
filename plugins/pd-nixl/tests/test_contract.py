"""The core's backend contract suite against real NIXL: UCX here, LIBFABRIC where it loads."""

from __future__ import annotations

import pytest

from pdcore.testing.backend_contract import BackendContract, CrossProcessBackendContract

pytest.importorskip("nixl._api", reason="nixl not installed")

UCX = {"SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX"}
PROGRESS_THREAD = {"PDCORE_NIXL_PROGRESS": "thread"}


class TestNixlUcxContract(BackendContract):
    backend_name = "nixl"
    context_env = UCX
    many_items = 5000
    dead_peer_timeout = 15.0
    # Both agents live in this one process here, so the closed receiver's memory stays mapped
    # and UCX (self/shm transports) may still complete a write into it, depending on how far
    # its endpoint teardown got (seen once in a loaded full run). A dead peer is a process
    # that is gone: the cross-process classes below kill one and require FAILED.
    detects_dead_peer = False


class TestNixlUcxCrossProcess(CrossProcessBackendContract):
    backend_name = "nixl"
    context_env = UCX
    many_items = 5000
    dead_peer_timeout = 15.0


class TestNixlUcxProgressThread(CrossProcessBackendContract):
    """NIXL's own progress thread in place of the pump (PDCORE_NIXL_PROGRESS=thread)."""

    backend_name = "nixl"
    context_env = PROGRESS_THREAD
    many_items = 2000
    dead_peer_timeout = 15.0
