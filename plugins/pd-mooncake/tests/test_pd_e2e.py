"""P + D + router with the mooncake backend (real processes on loopback, Mooncake over tcp):
SmolLM2 token-identical to unified; kill P, kill D, client disconnect."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pdcore.testing.backend_e2e import BackendE2E

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) not installed")


class TestMooncakeE2E(BackendE2E):
    backend = "mooncake"
    env: ClassVar[dict[str, str]] = {"MC_LOG_LEVEL": "WARNING", "MOONCAKE_PROTOCOL": "tcp"}
