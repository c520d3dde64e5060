"""First-party plugins that are not installed: `pdserve plugins` lists them with their install
command, and asking for one of their names (`--backend mooncake`) says which plugin to install.

In an environment without the plugins (CI's core matrix entry) the subprocess tests run against
the real metadata; where every plugin is installed, the in-process tests hide one from
importlib.metadata to check the same messages."""

from __future__ import annotations

import importlib.metadata as md
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdcore.errors import UnknownNameError
from pdcore.plugins import first_party
from pdcore.plugins.host import PluginHost
from pdcore.plugins.registry import Kind
from pdcore.plugins_cli import plugins_command
from pdcore.testing.processes import free_port

MISSING = [p for p in first_party.FIRST_PARTY if not p.installed()]
needs_missing = pytest.mark.skipif(
    not MISSING, reason="every first-party plugin is installed in this environment")


def builtin_only() -> PluginHost:
    return PluginHost(env={}, entry_points=[md.entry_points(group="pdcore")["builtin"]])


@pytest.fixture
def hide_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    real = md.distribution

    def distribution(name: str) -> md.Distribution:
        if name == "pd-mooncake":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(first_party.md, "distribution", distribution)


def test_install_command_from_checkout_or_index() -> None:
    staging = next(p for p in first_party.FIRST_PARTY if p.distribution == "pd-staging")
    assert staging.index_command() == "pip install pd-staging"
    checkout = staging.checkout_dir()
    if checkout is None:  # pdcore installed from a wheel: only the index can provide it
        assert staging.install_command() == "pip install pd-staging"
    else:
        assert checkout.name == "pd-staging" and (checkout / "src" / "pd_staging").is_dir()
        cmd = staging.install_command()
        assert cmd.startswith("pip install ") and cmd.endswith("plugins/pd-staging")
        assert Path(cmd.split()[-1]).resolve() == checkout.resolve()


def test_mooncake_command_picks_an_sdk_extra() -> None:
    mooncake = next(p for p in first_party.FIRST_PARTY if p.distribution == "pd-mooncake")
    assert mooncake.index_command() == "pip install 'pd-mooncake[cuda]'"
    assert "[cpu]" in mooncake.note


def test_listing_names_missing_plugin(hide_mooncake: None) -> None:
    out = io.StringIO()
    assert plugins_command(json_out=True, host=builtin_only(), stream=out) == 0
    missing = {m["distribution"]: m for m in json.loads(out.getvalue())["not_installed"]}
    assert "transfer_backend mooncake" in missing["pd-mooncake"]["provides"]
    assert missing["pd-mooncake"]["install_from_index"] == "pip install 'pd-mooncake[cuda]'"
    assert missing["pd-mooncake"]["install"].startswith("pip install '")
    text = io.StringIO()
    plugins_command(host=builtin_only(), stream=text)
    body = text.getvalue().split("Not installed (first-party plugins")[1]
    assert "pd-mooncake: transfer_backend mooncake" in body
    assert missing["pd-mooncake"]["install"] in body


def test_installed_plugins_are_not_listed() -> None:
    out = io.StringIO()
    plugins_command(json_out=True, host=builtin_only(), stream=out)
    listed = {m["distribution"] for m in json.loads(out.getvalue())["not_installed"]}
    assert listed == {p.distribution for p in MISSING}


def test_unknown_backend_names_the_plugin(hide_mooncake: None) -> None:
    registry = builtin_only().registries[Kind.TRANSFER_BACKEND]
    with pytest.raises(UnknownNameError) as err:
        registry.get("mooncake")
    msg = str(err.value)
    assert "comes from the pd-mooncake plugin, which is not installed: pip install '" in msg
    assert "[cuda]" in msg and "tcp" in msg  # the install command and what is installed


def test_unrelated_unknown_name_keeps_its_message() -> None:
    registry = builtin_only().registries[Kind.TRANSFER_BACKEND]
    with pytest.raises(UnknownNameError, match="unknown transfer_backend 'tpc'.*did you mean 'tcp'"):
        registry.get("tpc")


@needs_missing
def test_cli_lists_really_missing_plugins() -> None:
    r = subprocess.run([sys.executable, "-m", "pdcore", "plugins", "--json"],
                       capture_output=True, text=True, timeout=120, check=True)
    listed = {m["distribution"]: m for m in json.loads(r.stdout)["not_installed"]}
    for plugin in MISSING:
        assert listed[plugin.distribution]["install"] == plugin.install_command()
    text = subprocess.run([sys.executable, "-m", "pdcore", "plugins"], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    for plugin in MISSING:
        assert plugin.install_command() in text


@needs_missing
def test_serve_with_missing_backend_says_what_to_install(tiny_llama_dir: Path) -> None:
    plugin = next((p for p in MISSING if p.provides[0][0] == "transfer_backend"), None)
    if plugin is None:
        pytest.skip("every first-party transfer backend is installed here")
    backend = plugin.provides[0][1]
    r = subprocess.run(
        [sys.executable, "-m", "pdcore", "serve", "--model-path", str(tiny_llama_dir),
         "--disaggregation-mode", "prefill", "--backend", backend, "--host", "127.0.0.1",
         "--port", str(free_port())], capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert f"comes from the {plugin.distribution} plugin, which is not installed" in out, out
    assert plugin.install_command() in out, out
