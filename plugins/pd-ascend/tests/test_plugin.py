"""The installed plugin: entry point, the availability report, lazy vendor imports, and the npu
platform and pool on a machine without an NPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest
from ascend_helpers import clean_env
from pd_ascend.platform import NpuPlatform, npu_index

from pdcore.errors import ConfigError, PDError, UnavailableError
from pdcore.interfaces.memory import PoolContext
from pdcore.plugins.host import PluginHost, memory_pools, platforms, transfer_backends
from pdcore.plugins.registry import Kind

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
NO_TORCH_NPU = ("torch_npu is not installed (pip install torch-npu (pd-ascend's [npu] extra); "
                "needs Ascend CANN)")


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep for ep in metadata.entry_points(group="pdcore")}
    assert "ascend" in eps, "pip install --no-deps --no-build-isolation -e plugins/pd-ascend first"
    assert eps["ascend"].value == "pd_ascend.plugin"
    assert eps["ascend"].dist is not None and eps["ascend"].dist.name == "pd-ascend"


def test_components_register_under_one_plugin() -> None:
    host = PluginHost()
    assert "ascend" in host.plugins and not [f for f in host.failures if f.plugin == "ascend"]
    for kind, name in ((Kind.PLATFORM, "npu"), (Kind.MEMORY_POOL, "npu"),
                       (Kind.TRANSFER_BACKEND, "ascend")):
        entry = host.registry(kind).get(name)
        assert (entry.plugin, entry.distribution) == ("ascend", "pd-ascend")
        assert entry.description


def _plugins_json(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "pdcore.plugins_cli", "--json"], check=False,
                         capture_output=True, text=True, timeout=120, env=clean_env(**env))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _ours(report: dict) -> dict[tuple[str, str], dict]:
    return {(e["kind"], e["name"]): e for e in report["entries"] if e["plugin"] == "ascend"}


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_availability_report_without_npu() -> None:
    report = _plugins_json()
    ours = _ours(report)
    assert set(ours) == {("platform", "npu"), ("memory_pool", "npu"),
                         ("transfer_backend", "ascend")}
    for key in (("platform", "npu"), ("memory_pool", "npu")):
        assert ours[key]["available"] is False
        assert ours[key]["reason"] == NO_TORCH_NPU
    backend = ours[("transfer_backend", "ascend")]
    from pd_ascend.plugin import memfabric_availability

    assert (backend["available"], backend["reason"]) == memfabric_availability()
    assert not [f for f in report["failures"] if f.get("plugin") == "ascend"]


def test_backend_availability_follows_the_mooncake_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = transfer_backends().get("ascend")  # the probe reads the server's environment
    monkeypatch.setenv("ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE", "maybe")
    ok, reason = entry.available()
    assert not ok and "ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE='maybe' is not a boolean" in reason
    monkeypatch.setenv("ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE", "true")
    ok, reason = entry.available()
    if importlib.util.find_spec("pd_mooncake") is None:
        assert not ok and "pd-mooncake plugin is not installed" in reason
    else:
        assert (ok, reason) == (True, "")  # the Mooncake wheel is checked when the engine is built
    monkeypatch.setenv("ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE", "false")
    from pd_ascend.plugin import memfabric_availability

    assert entry.available() == memfabric_availability()


LAZY = textwrap.dedent("""
    import json, sys
    from pdcore.plugins.host import memory_pools, platforms, transfer_backends
    answers = [platforms().get("npu").available(), memory_pools().get("npu").available(),
               transfer_backends().get("ascend").available()]
    heavy = ["memfabric_hybrid", "torch_npu", "pd_mooncake", "mooncake", "pd_ascend.platform",
             "pd_ascend.memfabric_engine"]
    print(json.dumps({"loaded": [m for m in heavy if m in sys.modules], "answers": answers}))
""")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed: the probe imports it")
def test_listing_imports_no_vendor_sdk() -> None:
    # only our plugin (and the core's builtin): pd-mooncake's own plugin imports pd_mooncake
    out = subprocess.run([sys.executable, "-c", LAZY], check=False, capture_output=True,
                         text=True, timeout=120, env=clean_env(PDCORE_PLUGINS="ascend"))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["loaded"] == []
    assert len(result["answers"]) == 3


def test_npu_platform_without_npu() -> None:
    p = platforms().get("npu").factory()
    assert isinstance(p, NpuPlatform)
    assert (p.dist_backend, p.default_pool, p.memory_kind.value) == ("hccl", "npu", "npu")
    with pytest.raises(ConfigError, match="must be >= 0"):
        p.device_for_rank(-1)
    with pytest.raises(ConfigError, match="must be >= 0"):
        p.device_for_rank(0, base_gpu_id=-2)
    if HAS_TORCH_NPU and p.availability()[0]:
        pytest.skip("an NPU answers here")
    with pytest.raises(UnavailableError, match="platform 'npu' is not available here"):
        p.device_for_rank(0)
    with pytest.raises(UnavailableError):
        p.memory_info("npu:0")
    with pytest.raises(UnavailableError, match=r"platform 'npu' is not available here: .*"):
        platforms().create("npu")


def test_physical_npu_id() -> None:
    assert NpuPlatform(env={}).physical_id("npu:3") == 3
    assert NpuPlatform(env={"ASCEND_NPU_PHY_ID": "-1"}).physical_id("npu:3") == 3
    assert NpuPlatform(env={"ASCEND_NPU_PHY_ID": "6"}).physical_id("npu:0") == 6
    with pytest.raises(ConfigError, match="ASCEND_NPU_PHY_ID"):
        NpuPlatform(env={"ASCEND_NPU_PHY_ID": "six"}).physical_id("npu:0")


@pytest.mark.parametrize("device, index", [("npu", 0), ("npu:0", 0), ("npu:7", 7)])
def test_npu_index(device: str, index: int) -> None:
    assert npu_index(device) == index


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "npu:x", "npu:-1"])
def test_npu_index_refuses_other_devices(device: str) -> None:
    with pytest.raises(ConfigError, match="expected an NPU device"):
        npu_index(device)


def test_npu_pool_without_npu() -> None:
    from pd_ascend.pool import NpuMemoryPool

    with pytest.raises(PDError, match="run with --device npu"):
        NpuMemoryPool(PoolContext(device="cpu"))
    if HAS_TORCH_NPU and platforms().get("npu").available()[0]:
        pytest.skip("an NPU answers here")
    with pytest.raises(UnavailableError, match="'npu' is not available here: torch_npu"):
        memory_pools().create("npu", PoolContext(device="npu:0"))
    with pytest.raises(UnavailableError, match="torch_npu"):
        NpuMemoryPool(PoolContext(device="npu:0"))
