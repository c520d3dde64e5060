"""The installed plugin: entry point, registry entry, availability with the SDK present or
blocked (and the other backends still working)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

from pdcore.plugins.host import PluginHost
from pdcore.plugins.registry import Kind


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep for ep in metadata.entry_points(group="pdcore")}
    assert "nixl" in eps, "pip install -e plugins/pd-nixl first"
    assert eps["nixl"].value == "pd_nixl.plugin"
    assert eps["nixl"].dist is not None and eps["nixl"].dist.name == "pd-nixl"


def test_backend_appears_in_the_registry() -> None:
    host = PluginHost()
    assert "nixl" in host.plugins and not [f for f in host.failures if f.plugin == "nixl"]
    entry = host.registry(Kind.TRANSFER_BACKEND).get("nixl")
    assert entry.distribution == "pd-nixl"
    pytest.importorskip("nixl._api", reason="nixl not installed")
    assert entry.available() == (True, "")


BLOCKED = textwrap.dedent("""
    import importlib.abc, json, os, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13", "nixl_rocm"):
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
           "available": backends.get("nixl").available()}
    try:
        backends.create("nixl", BackendContext())
    except UnavailableError as e:
        out["create"] = str(e)
    tcp = backends.create("tcp", BackendContext(host="127.0.0.1"))  # others still work
    out["tcp_endpoint"] = bool(tcp.endpoint())
    tcp.close()
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)
""")


def test_blocked_sdk_is_reported_and_other_backends_still_work() -> None:
    proc = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failures"] == []
    ok, reason = out["available"]
    assert not ok and reason.startswith("nixl is not installed: pip install nixl")
    assert reason in out["create"]
    assert out["tcp_endpoint"] is True


def test_preflight_does_not_call_the_nixl_variables_ignored(tmp_path) -> None:
    """#45 item 13: `pdserve serve --disaggregation-transfer-backend nixl` with
    SGLANG_DISAGGREGATION_NIXL_BACKEND set warned that the variable was ignored, while the
    backend reads it (pd_nixl.settings): the backend now declares what it reads."""
    from pdcore.config import ServerArgs
    from pdcore.server.startup.preflight import _warnings

    args = ServerArgs(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl")
    env = {"SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX",
           "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": "{}",
           "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "NVLINK"}
    lines = _warnings(args, env)
    assert not [ln for ln in lines if "NIXL" in ln], lines
    # a variable nixl does not read is still named
    assert any("SGLANG_MOONCAKE_CUSTOM_MEM_POOL is set but ignored" in ln for ln in lines), lines
