"""The core's contract suites against pd-ascend's components.

The platform contract runs everywhere (declarations, availability, default pool; the device
checks skip where no NPU answers). The backend and pool suites need an NPU: they carry the `npu`
marker and skip with the exact reason the component gives here. For the backend that reason is
memfabric's own refusal, obtained by really starting a memfabric engine against a config store
on 127.0.0.1 (on a machine without the Ascend driver: "... the current version of ascend driver
does not support mf! ...").
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcore.errors import PDError
from pdcore.interfaces.transfer import BackendContext
from pdcore.testing.backend_contract import BackendContract, CrossProcessBackendContract
from pdcore.testing.platform_contract import PlatformContract
from pdcore.testing.pool_contract import PoolContract

ENGINE = "pd_ascend.memfabric_engine:create"


@pytest.fixture(scope="session")
def memfabric_skip_reason(mf_store: str) -> str | None:
    """None when a real memfabric engine starts here, else why not (memfabric's words)."""
    from pd_ascend import memfabric_engine

    try:
        engine = memfabric_engine.create(BackendContext(
            role="prefill", host="127.0.0.1", env={"ASCEND_MF_STORE_URL": mf_store}))
    except PDError as e:
        return f"memfabric's transfer engine cannot start here: {e}"
    engine.close()
    return None


class _NeedsMemfabricEngine:
    @pytest.fixture(autouse=True)
    def _memfabric_or_skip(self, request: pytest.FixtureRequest, mf_store: str,
                           memfabric_skip_reason: str | None) -> Iterator[None]:
        if memfabric_skip_reason is not None:
            pytest.skip(memfabric_skip_reason)
        request.cls.context_env = {"ASCEND_MF_STORE_URL": mf_store}
        yield


@pytest.mark.npu
class TestAscendBackend(_NeedsMemfabricEngine, BackendContract):
    engine_factory = ENGINE
    pool_name = "npu"
    device = "npu:0"
    dead_peer_timeout = 60.0


@pytest.mark.npu
class TestAscendBackendAcrossProcesses(_NeedsMemfabricEngine, CrossProcessBackendContract):
    engine_factory = ENGINE
    pool_name = "npu"
    device = "npu:0"
    dead_peer_timeout = 60.0


@pytest.mark.npu
class TestNpuPool(PoolContract):
    pool_name = "npu"
    device = "npu:0"


class TestNpuPlatform(PlatformContract):
    platform_name = "npu"


def test_backend_contract_skips_with_memfabric_reason(memfabric_skip_reason: str | None) -> None:
    """What the skips above say on this machine (pins the reason, so it cannot silently become
    a different one)."""
    from pd_ascend.settings import ascend_driver_file

    if ascend_driver_file() is not None:
        pytest.skip("the Ascend driver is installed here; memfabric may start")
    assert memfabric_skip_reason is not None
    assert "the current version of ascend driver does not support mf!" in memfabric_skip_reason
