"""The core's backend contract suite against the real Mooncake engine (TCP transport here)."""

from __future__ import annotations

import pytest

from pdcore.testing.backend_contract import BackendContract, CrossProcessBackendContract

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) not installed")

TCP = {"MOONCAKE_PROTOCOL": "tcp"}


class TestMooncakeContract(BackendContract):
    backend_name = "mooncake"
    context_env = TCP
    many_items = 5000  # > the ~2048 requests mooncake accepts in flight per peer
    dead_peer_timeout = 15.0


class TestMooncakeCrossProcess(CrossProcessBackendContract):
    backend_name = "mooncake"
    context_env = TCP
    many_items = 5000
    dead_peer_timeout = 15.0

