"""ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE=true: backend `ascend` through pd-mooncake."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from pd_ascend import mooncake_ascend
from pd_ascend.plugin import create_backend

from pdcore.errors import ConfigError
from pdcore.interfaces.transfer import BackendContext

ON = {"ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE": "true"}
HAS_MOONCAKE = (importlib.util.find_spec("pd_mooncake") is not None
                and importlib.util.find_spec("mooncake") is not None)


def _block(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make `modules` unimportable in this process (as if not installed)."""
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_missing_pd_mooncake_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _block(monkeypatch, "pd_mooncake")
    with pytest.raises(ConfigError) as e:
        create_backend(BackendContext(role="prefill", env=ON))
    msg = str(e.value)
    assert "ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE=true" in msg
    assert "the pd-mooncake plugin is not installed" in msg
    assert "pip install ./plugins/pd-mooncake mooncake-transfer-engine-npu" in msg
    assert "or unset ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE" in msg


@pytest.mark.skipif(importlib.util.find_spec("pd_mooncake") is None,
                    reason="pd-mooncake not installed")
def test_missing_mooncake_sdk_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _block(monkeypatch, "mooncake")
    monkeypatch.delitem(sys.modules, "pd_mooncake.engine", raising=False)
    with pytest.raises(ConfigError, match="pd-mooncake is installed but the mooncake SDK is not"):
        create_backend(BackendContext(role="prefill", env=ON))


@pytest.mark.skipif(not HAS_MOONCAKE, reason="pd-mooncake and a mooncake wheel not installed")
def test_a_mooncake_wheel_without_ascend_transport_is_refused() -> None:
    wheels = mooncake_ascend.mooncake_wheels()
    if mooncake_ascend.NPU_WHEEL in wheels:
        pytest.skip("the Ascend build of Mooncake is installed here")
    with pytest.raises(ConfigError) as e:
        create_backend(BackendContext(role="prefill", host="127.0.0.1", env=ON))
    msg = str(e.value)
    assert "needs Mooncake's Ascend build (mooncake-transfer-engine-npu)" in msg
    assert all(w in msg for w in wheels)  # names what is installed instead


@pytest.mark.skipif(not HAS_MOONCAKE, reason="pd-mooncake and a mooncake wheel not installed")
def test_engine_wiring_against_the_real_pd_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds the Ascend variant of pd-mooncake's engine with whatever Mooncake wheel is here.

    Mooncake's non-NPU wheels accept protocol 'ascend' (that is why create() checks the wheel),
    so this exercises our initialization against the real pd-mooncake class: the attributes its
    methods rely on exist, the local name carries ASCEND_NPU_PHY_ID, close() is idempotent. It
    moves no bytes: that needs the NPU build and hardware.
    """
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")
    cls = mooncake_ascend.engine_class(mooncake_ascend.load_engine_module())
    env = {**ON, "ASCEND_NPU_PHY_ID": "5", "MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}
    engine = cls(BackendContext(role="decode", host="127.0.0.1", gpu_id=1, env=env,
                                ib_device="mlx5_0"))
    try:
        assert engine.name == "ascend" and engine.npu_phy_id == 5
        assert engine.settings.protocol == "ascend" and engine.settings.device_name == ""
        host, _, port = engine.endpoint().decode().rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert engine.describe()["transport"] == "ascend"
        assert {k.value for k in engine.capabilities.memory_kinds} == {"npu", "host"}
    finally:
        engine.close()
        engine.close()
