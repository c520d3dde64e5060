"""`pdserve plugins`: table, JSON, typer wiring, and a real third-party distribution."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from importlib import metadata

import typer
from plugins_throwaway import THROWAWAY_DIST, THROWAWAY_VERSION
from typer.testing import CliRunner

from pdcore.plugins.host import PluginHost
from pdcore.plugins.registry import Kind
from pdcore.plugins_cli import main, plugins_command, register_plugins_command


def builtin_only() -> PluginHost:
    return PluginHost(env={}, entry_points=[metadata.entry_points(group="pdcore")["builtin"]])


def test_table_lists_every_name_with_availability() -> None:
    out = io.StringIO()
    assert plugins_command(host=builtin_only(), stream=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["KIND", "NAME", "PLUGIN", "DISTRIBUTION", "VERSION", "AVAILABLE",
                                "REASON"]
    rows = {tuple(line.split()[:2]): line.split() for line in lines[1:]}
    version = metadata.version("pdcore")
    assert rows[("platform", "cpu")][2:6] == ["builtin", "pdcore", version, "yes"]
    assert rows[("memory_pool", "torch")][5] == "yes"
    for key in [("transfer_backend", n) for n in ("tcp", "shm", "fake")] + [
            ("memory_pool", "pinned"), ("platform", "cuda"), ("transfer_planner", "default")]:
        assert key in rows, key
    cuda = rows[("platform", "cuda")]
    if cuda[5] == "no":
        assert " ".join(cuda[6:]).startswith("torch sees no CUDA device")


def test_json_output_and_failures_exit_1() -> None:
    host = PluginHost(env={"PDCORE_PLUGINS": "nosuch"},
                      entry_points=[metadata.entry_points(group="pdcore")["builtin"]])
    out = io.StringIO()
    assert plugins_command(json_out=True, host=host, stream=out) == 1
    data = json.loads(out.getvalue())
    assert {"plugins", "entries", "conflicts", "failures", "skipped"} <= set(data)
    cpu = next(e for e in data["entries"] if (e["kind"], e["name"]) == ("platform", "cpu"))
    assert cpu["available"] is True and cpu["distribution"] == "pdcore"
    assert data["failures"][0]["plugin"] == "nosuch"
    text = io.StringIO()
    plugins_command(host=host, stream=text)
    assert "Failed plugins:\n  nosuch: PDCORE_PLUGINS names 'nosuch'" in text.getvalue()


def test_typer_command_and_bad_argument(capsys: object) -> None:
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """pdserve"""

    register_plugins_command(app)
    result = CliRunner().invoke(app, ["plugins", "--json"])
    assert result.exit_code in (0, 1), result.output
    names = {(e["kind"], e["name"]) for e in json.loads(result.output)["entries"]}
    assert ("platform", "cpu") in names
    assert CliRunner().invoke(app, ["plugins", "--bogus"]).exit_code == 2
    assert main(["--bogus"]) == 2


def test_throwaway_distribution_is_listed(throwaway_pool_plugin: str) -> None:
    """A pip-installed third-party plugin shows up with its distribution and version, and its
    pool works, in a fresh process."""
    run = [sys.executable, "-m", "pdcore.plugins_cli", "--json"]
    # exit status 1 is fine here: another installed plugin may be failing on this machine
    listing = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    data = json.loads(listing.stdout)
    entry = next(e for e in data["entries"] if e["name"] == throwaway_pool_plugin)
    assert (entry["kind"], entry["plugin"], entry["distribution"], entry["version"],
            entry["available"]) == ("memory_pool", "mypool", THROWAWAY_DIST, THROWAWAY_VERSION,
                                    True)
    code = ("import torch; from pdcore.plugins.host import memory_pools; "
            "from pdcore.interfaces.memory import PoolContext; "
            f"p = memory_pools().create({throwaway_pool_plugin!r}, PoolContext()); "
            "b = p.allocate('k', (4, 2), torch.float16); print(p.name, b.region.length)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.stdout.split() == ["mypool", "16"], out.stderr
    text = subprocess.run([sys.executable, "-m", "pdcore.plugins_cli"], capture_output=True,
                          text=True, timeout=120, check=False).stdout
    assert any(line.split()[:5] == ["memory_pool", "mypool", "mypool", THROWAWAY_DIST,
                                    THROWAWAY_VERSION] for line in text.splitlines()), text


def test_allow_and_deny_lists_with_an_installed_plugin(throwaway_pool_plugin: str) -> None:
    pools = Kind.MEMORY_POOL
    assert throwaway_pool_plugin in PluginHost(env={}).registry(pools)
    only_builtin = PluginHost(env={"PDCORE_PLUGINS": "builtin"})
    assert only_builtin.skip_reasons.get("mypool") == "not in PDCORE_PLUGINS"
    assert throwaway_pool_plugin not in only_builtin.registry(pools)
    denied = PluginHost(env={"PDCORE_DISABLE_PLUGINS": "mypool"})
    assert denied.skip_reasons.get("mypool") == "disabled by PDCORE_DISABLE_PLUGINS"
    only_mine = PluginHost(env={"PDCORE_PLUGINS": "mypool"})
    assert {"builtin", "mypool"} <= set(only_mine.plugins)
    assert {"torch", throwaway_pool_plugin} <= set(only_mine.registry(pools).names())
