"""P + D + router with the nixl backend (UCX, real processes on loopback): SmolLM2
token-identical to unified; kill P, kill D, client disconnect."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pdcore.testing.backend_e2e import BackendE2E

pytest.importorskip("nixl._api", reason="nixl not installed")


class TestNixlE2E(BackendE2E):
    backend = "nixl"
    env: ClassVar[dict[str, str]] = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
