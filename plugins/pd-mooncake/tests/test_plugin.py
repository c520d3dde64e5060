"""The installed plugin: entry point, registry entries, availability with the SDK present or
blocked, and the CUDA memory pools (gpu tests skip with a reason on CPU machines)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

from pdcore.plugins.host import PluginHost
from pdcore.plugins.registry import Kind

POOLS = ("mooncake-nvlink", "mooncake-barex", "mooncake-intra-node-nvlink")


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep for ep in metadata.entry_points(group="pdcore")}
    assert "mooncake" in eps, "pip install -e plugins/pd-mooncake first"
    assert eps["mooncake"].value == "pd_mooncake.plugin"
    assert eps["mooncake"].dist is not None and eps["mooncake"].dist.name == "pd-mooncake"


def test_backend_and_pools_appear_in_the_registry() -> None:
    host = PluginHost()
    assert "mooncake" in host.plugins and not [f for f in host.failures if f.plugin == "mooncake"]
    entry = host.registry(Kind.TRANSFER_BACKEND).get("mooncake")
    assert entry.distribution == "pd-mooncake"
    pytest.importorskip("mooncake.engine", reason="mooncake SDK not installed")
    assert entry.available() == (True, "")
    pools = host.registry(Kind.MEMORY_POOL)
    for name in POOLS:
        ok, reason = pools.get(name).available()
        import torch

        if not torch.cuda.is_available():
            assert not ok and "needs a CUDA GPU" in reason


BLOCKED = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mooncake" or name.startswith("mooncake."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    from pdcore.errors import UnavailableError
    from pdcore.interfaces.transfer import BackendContext
    from pdcore.plugins.host import PluginHost
    from pdcore.plugins.registry import Kind

    host = PluginHost()
    backends = host.registry(Kind.TRANSFER_BACKEND)
    out = {"failures": [f.reason for f in host.failures],
           "available": backends.get("mooncake").available(),
           "pool": host.registry(Kind.MEMORY_POOL).get("mooncake-nvlink").available()}
    try:
        backends.create("mooncake", BackendContext())
    except UnavailableError as e:
        out["create"] = str(e)
    tcp = backends.create("tcp", BackendContext(host="127.0.0.1"))  # others still work
    out["tcp_endpoint"] = bool(tcp.endpoint())
    tcp.close()
    print(json.dumps(out))
""")


def test_blocked_sdk_is_reported_and_other_backends_still_work() -> None:
    proc = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failures"] == []  # the plugin itself loads without its SDK
    ok, reason = out["available"]
    assert not ok
    assert reason.startswith("mooncake-transfer-engine is not installed: pip install "
                             "mooncake-transfer-engine on GPU machines")
    assert "mooncake-transfer-engine-non-cuda" in reason
    assert out["pool"] == [False, reason]
    assert reason in out["create"]
    assert out["tcp_endpoint"] is True


@pytest.mark.gpu
def test_cuda_pool_registers_with_the_engine() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    from pd_mooncake.plugin import POOLS as KINDS
    from pd_mooncake.plugin import sdk_availability

    from pdcore.interfaces.memory import PoolContext
    from pdcore.interfaces.transfer import BackendContext, MemoryKind

    ok, reason = sdk_availability()
    if not ok:
        pytest.skip(reason)
    host = PluginHost()
    for name in POOLS:
        ok, reason = host.registry(Kind.MEMORY_POOL).get(name).available()
        if not ok:
            continue  # this wheel/machine lacks that transport: availability says why
        pool = host.registry(Kind.MEMORY_POOL).create(name, PoolContext(device="cuda:0"))
        env = {"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": KINDS[name], "MOONCAKE_PROTOCOL": "tcp"}
        engine = host.registry(Kind.TRANSFER_BACKEND).create(
            "mooncake", BackendContext(device="cuda:0", env=env))
        try:
            buf = pool.allocate("k", (1 << 20,), torch.bfloat16)
            assert buf.region.kind is MemoryKind.CUDA and buf.tensor.is_cuda
            assert not buf.tensor.any()
            engine.register([buf.region])
        finally:
            engine.close()
            pool.close()
