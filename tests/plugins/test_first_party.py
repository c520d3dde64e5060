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

# the checkout these tests live in (pdcore itself may be installed from a wheel, as in CI)
CHECKOUT = Path(__file__).resolve().parents[2]

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
    monkeypatch.chdir(CHECKOUT)  # a checkout is known even when pdcore came from a wheel


def test_install_command_from_checkout_or_none() -> None:
    staging = next(p for p in first_party.FIRST_PARTY if p.distribution == "pd-staging")
    checkout = staging.checkout_dir()
    if checkout is None:  # pdcore installed from a wheel, no checkout recorded or here
        assert staging.install_command() == ""
        assert "not published on any package index" in staging.how_to_install()
    else:
        assert checkout.name == "pd-staging" and (checkout / "src" / "pd_staging").is_dir()
        cmd = staging.install_command()
        assert cmd.startswith(first_party.pip_command() + " install ")
        assert cmd.endswith("plugins/pd-staging") and staging.how_to_install() == cmd
        assert Path(cmd.split()[-1]).resolve() == checkout.resolve()


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pdcore as if installed from a wheel into a fresh environment (sys.prefix), run from an
    empty folder: no checkout known."""
    monkeypatch.setattr(first_party, "__file__", str(tmp_path / "site" / "pdcore" / "plugins"
                                                     / "first_party.py"))
    monkeypatch.setattr(first_party.sys, "prefix", str(tmp_path / "venv"))
    (tmp_path / "venv").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def test_no_checkout_no_package_name_to_install(elsewhere: Path) -> None:
    """The plugins are on no index: without a checkout the hint says so and how to get one,
    never `pip install pd-X` (a name no index has)."""
    for plugin in first_party.FIRST_PARTY:
        assert plugin.checkout_dir() is None and plugin.install_command() == ""
        hint = plugin.how_to_install()
        assert "not published on any package index" in hint
        assert f"install {plugin.distribution}" not in hint, hint
        assert f"CHECKOUT/plugins/{plugin.distribution}" in hint


def test_the_checkout_setup_sh_recorded_is_used(elsewhere: Path) -> None:
    """setup.sh installs from a temporary copy and writes the checkout's path into the
    environment; the hint then installs from that checkout's plugins/ folder with the
    environment's own pip."""
    (elsewhere / "venv" / first_party.CHECKOUT_FILE).write_text(str(CHECKOUT) + "\n")
    mooncake = next(p for p in first_party.FIRST_PARTY if p.distribution == "pd-mooncake")
    cmd = mooncake.install_command()
    assert cmd == (f"{first_party.pip_command()} install "
                   f"'{CHECKOUT / 'plugins' / 'pd-mooncake'}[cuda]'")
    assert "[cpu]" in mooncake.note


def test_the_current_folder_when_it_is_a_checkout(elsewhere: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CHECKOUT)
    staging = next(p for p in first_party.FIRST_PARTY if p.distribution == "pd-staging")
    assert staging.install_command() == f"{first_party.pip_command()} install ./plugins/pd-staging"


def test_listing_names_missing_plugin(hide_mooncake: None) -> None:
    out = io.StringIO()
    assert plugins_command(json_out=True, host=builtin_only(), stream=out) == 0
    missing = {m["distribution"]: m for m in json.loads(out.getvalue())["not_installed"]}
    assert "transfer_backend mooncake" in missing["pd-mooncake"]["provides"]
    assert missing["pd-mooncake"]["how_to_install"] == missing["pd-mooncake"]["install"]
    assert missing["pd-mooncake"]["install"].startswith(first_party.pip_command() + " install '")
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
    assert ("comes from the pd-mooncake plugin, which is not installed: "
            f"{first_party.pip_command()} install '") in msg
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
        assert plugin.how_to_install() in text


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
    assert plugin.how_to_install() in out, out
