"""Plugin host: discovery, allow/deny lists, failures, duplicates, unknown names, laziness."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import pytest

from pdcore.errors import DuplicateNameError, PluginError, UnavailableError, UnknownNameError
from pdcore.plugins import host as host_mod
from pdcore.plugins.host import PluginHost, get_host, memory_pools, platforms, transfer_backends
from pdcore.plugins.lazy import importable, lazy
from pdcore.plugins.registry import Entry, Kind

MakeDist = Callable[..., list[metadata.EntryPoint]]


def builtin_ep() -> metadata.EntryPoint:
    return metadata.entry_points(group="pdcore")["builtin"]


@pytest.fixture
def make_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeDist]:
    """Write plugin modules plus a *.dist-info with entry points; return its EntryPoints."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules: list[str] = []

    def make(dist: str, version: str, sources: dict[str, str]) -> list[metadata.EntryPoint]:
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = "".join(f"{m} = {m}\n" for m in sources)
        (info / "entry_points.txt").write_text(f"[pdcore]\n{eps}")
        for mod, src in sources.items():
            (tmp_path / f"{mod}.py").write_text(
                "from pdcore.plugins import hookimpl\n" + textwrap.dedent(src))
            modules.append(mod)
        return list(metadata.PathDistribution(info).entry_points)

    yield make
    for mod in modules:
        sys.modules.pop(mod, None)


GOOD = """
@hookimpl
def pd_register_transfer_backends(register):
    register("alpha", lambda ctx: ("alpha-engine", ctx), description="first")

@hookimpl
def pd_register_memory_pools(register):
    register("alphapool", lambda ctx: "pool")
"""
DUP = """
@hookimpl
def pd_register_transfer_backends(register):
    register("alpha", lambda ctx: "other alpha")
    register("beta", lambda ctx: "beta-engine")
"""
BROKEN = """
raise ImportError("needs libfoo: pip install foo")
"""


def test_builtin_registers_every_kind(fresh_host: None) -> None:
    version = metadata.version("pdcore")
    assert {"tcp", "shm", "fake"} <= set(transfer_backends().names())
    assert {"torch", "pinned", "shm"} <= set(memory_pools().names())
    assert {"cpu", "cuda"} <= set(platforms().names())
    assert "default" in host_mod.transfer_planners()
    for reg in get_host().registries.values():
        for e in reg.entries():
            if e.plugin == "builtin":
                assert (e.distribution, e.version) == ("pdcore", version)
    assert platforms().get("cpu").available() == (True, "")


def test_loading_plugins_imports_no_torch_nor_backend() -> None:
    code = ("import sys; from pdcore.plugins.host import get_host; h = get_host(); "
            "print(sorted(h.plugins), 'torch' in sys.modules, "
            "any(m.startswith('pdcore.builtin.tcp') for m in sys.modules))")
    env = {**os.environ, "PDCORE_PLUGINS": "builtin"}  # other installed plugins may differ
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, env=env).stdout
    assert out.split()[-2:] == ["False", "False"], out


def test_failing_plugin_is_reported_not_fatal(make_dist: MakeDist) -> None:
    eps = make_dist("good-dist", "1.0", {"good_plug": GOOD}) + \
        make_dist("broken-dist", "2.0", {"broken_plug": BROKEN})
    host = PluginHost(env={}, entry_points=[builtin_ep(), *eps])
    [failure] = host.failures
    assert (failure.plugin, failure.distribution) == ("broken_plug", "broken-dist")
    assert "needs libfoo: pip install foo" in failure.reason
    reg = host.registry(Kind.TRANSFER_BACKEND)
    assert reg.create("alpha", "ctx") == ("alpha-engine", "ctx")
    assert reg.get("alpha").distribution == "good-dist" and reg.get("alpha").version == "1.0"
    with pytest.raises(UnknownNameError, match=r"(?s)installed: alpha, fake.*broken_plug"):
        reg.get("gamma")


def test_duplicate_name_is_a_conflict_naming_both(make_dist: MakeDist) -> None:
    eps = make_dist("good-dist", "1.0", {"good_plug": GOOD}) + \
        make_dist("dup-dist", "3.1", {"dup_plug": DUP})
    host = PluginHost(env={}, entry_points=eps)
    reg = host.registry(Kind.TRANSFER_BACKEND)
    with pytest.raises(DuplicateNameError) as err:
        reg.get("alpha")
    msg = str(err.value)
    assert "good-dist 1.0 (plugin good_plug)" in msg and "dup-dist 3.1 (plugin dup_plug)" in msg
    assert "PDCORE_DISABLE_PLUGINS" in msg and "Installed transfer_backend names: beta" in msg
    assert reg.create("beta", None) == "beta-engine"  # the plugin's other names still work
    assert "alpha" not in reg.names() and list(reg.conflicts()) == ["alpha"]
    assert any("registered by more than one plugin" in f.reason for f in host.failures)
    # disabling one owner resolves it
    host2 = PluginHost(env={"PDCORE_DISABLE_PLUGINS": "dup_plug"}, entry_points=eps)
    assert host2.registry(Kind.TRANSFER_BACKEND).create("alpha", 1) == ("alpha-engine", 1)


def test_unknown_name_lists_installed_and_suggests(fresh_host: None) -> None:
    with pytest.raises(UnknownNameError) as err:
        transfer_backends().get("tpc")
    msg = str(err.value)
    assert f"installed: {', '.join(transfer_backends().names())} (" in msg
    assert "did you mean 'tcp'" in msg and "pdserve plugins" in msg


def test_allow_list_keeps_builtin(make_dist: MakeDist) -> None:
    eps = [builtin_ep(), *make_dist("good-dist", "1.0", {"good_plug": GOOD}),
           *make_dist("dup-dist", "1.0", {"dup_plug": DUP})]
    host = PluginHost(env={"PDCORE_PLUGINS": "good_plug"}, entry_points=eps)
    assert set(host.plugins) == {"builtin", "good_plug"}
    assert host.skip_reasons == {"dup_plug": "not in PDCORE_PLUGINS"}
    assert "alpha" in host.registry(Kind.TRANSFER_BACKEND)  # no conflict: dup_plug skipped
    assert "cpu" in host.registry(Kind.PLATFORM)
    assert not host.failures


def test_deny_list(make_dist: MakeDist) -> None:
    eps = [builtin_ep(), *make_dist("good-dist", "1.0", {"good_plug": GOOD})]
    host = PluginHost(env={"PDCORE_DISABLE_PLUGINS": "builtin, good_plug"}, entry_points=eps)
    assert host.plugins == {} and host.skipped == ["builtin", "good_plug"]
    assert host.skip_reasons["builtin"] == "disabled by PDCORE_DISABLE_PLUGINS"
    with pytest.raises(UnknownNameError, match="skipped plugins: builtin"):
        host.registry(Kind.PLATFORM).get("cpu")
    # deny wins over allow
    host = PluginHost(env={"PDCORE_PLUGINS": "good_plug", "PDCORE_DISABLE_PLUGINS": "good_plug"},
                      entry_points=eps)
    assert set(host.plugins) == {"builtin"}


def test_unmatched_allow_or_deny_name_is_reported(make_dist: MakeDist) -> None:
    eps = make_dist("good-dist", "1.0", {"good_plug": GOOD})
    host = PluginHost(env={"PDCORE_PLUGINS": "good_plug,nosuch"}, entry_points=eps)
    [failure] = host.failures
    assert failure.plugin == "nosuch" and "PDCORE_PLUGINS names 'nosuch'" in failure.reason


def test_bad_hook_implementations_are_failures(make_dist: MakeDist) -> None:
    eps = make_dist("odd-dist", "0.1", {
        "typo_plug": """
            @hookimpl
            def pd_register_transfer_backend(register):
                register("typo", lambda ctx: None)
        """,
        "raising_plug": """
            @hookimpl
            def pd_register_platforms(register):
                raise RuntimeError("boom")

            @hookimpl
            def pd_register_transfer_planners(register):
                register("plan-ok", lambda: "planner")
                register("Bad Name", lambda: None)
        """,
        "badsig_plug": """
            @hookimpl
            def pd_register_memory_pools(reg):
                reg("x", lambda ctx: None)
        """,
    })
    host = PluginHost(env={}, entry_points=eps)
    reasons = {f.plugin: [] for f in host.failures}
    for f in host.failures:
        reasons[f.plugin].append(f.reason)
    assert "unknown hook(s) pd_register_transfer_backend" in reasons["typo_plug"][0]
    assert any("pd_register_platforms: RuntimeError: boom" in r for r in reasons["raising_plug"])
    assert any("'Bad Name' must be a non-empty lowercase word" in r
               for r in reasons["raising_plug"])
    assert "reg" in reasons["badsig_plug"][0]
    assert host.registry(Kind.TRANSFER_PLANNER).create("plan-ok") == "planner"
    assert set(host.plugins) == {"raising_plug"}


def test_registries_are_read_only_after_loading() -> None:
    host = PluginHost(env={}, entry_points=[])
    reg = host.registry(Kind.MEMORY_POOL)
    with pytest.raises(PluginError, match="read-only"):
        reg.add(Entry(Kind.MEMORY_POOL, "late", lambda ctx: None, "x", "x", "1"))


def test_in_process_extra_plugin() -> None:
    from pdcore.plugins import hookimpl

    class Mine:
        __name__ = "mine"

        @hookimpl
        def pd_register_memory_pools(self, register: Callable[..., None]) -> None:
            register("heap", lambda ctx: f"heap for {ctx}", availability=lambda: (False, "no"))

    host = PluginHost(env={}, entry_points=[], extra=[Mine()])
    entry = host.registry(Kind.MEMORY_POOL).get("heap")
    assert (entry.plugin, entry.distribution) == ("mine", "<in-process>")
    assert entry.available() == (False, "no")
    with pytest.raises(UnavailableError, match="memory_pool 'heap' is not available here: no"):
        host.registry(Kind.MEMORY_POOL).create("heap", "ctx")


def test_plugin_reading_registries_while_loading_fails_clearly(
        make_dist: MakeDist, monkeypatch: pytest.MonkeyPatch, fresh_host: None) -> None:
    eps = make_dist("loop-dist", "1.0", {"loop_plug": """
        from pdcore.plugins.host import transfer_backends

        @hookimpl
        def pd_register_memory_pools(register):
            transfer_backends()
    """})
    monkeypatch.setattr(host_mod.metadata, "entry_points", lambda group: eps)
    host = get_host()
    [failure] = host.failures
    assert "while plugins were loading" in failure.reason


def test_lazy_factory_imports_on_first_call(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "lazy_target_mod.py").write_text("IMPORTED = True\nclass Thing:\n"
                                                 "    def __init__(self, x):\n        self.x = x\n")
    monkeypatch.delitem(sys.modules, "lazy_target_mod", raising=False)
    factory = lazy("lazy_target_mod:Thing")
    assert importable("lazy_target_mod:Thing")() == (True, "")
    assert "lazy_target_mod" not in sys.modules
    assert factory(7).x == 7 and "lazy_target_mod" in sys.modules
    ok, reason = importable("no_such_mod_xyz:X", install="pip install xyz")()
    assert not ok and reason == "module no_such_mod_xyz not found; pip install xyz"
    ok, reason = importable("no_such_pkg_xyz.sub:X")()
    assert not ok and "no_such_pkg_xyz" in reason
    with pytest.raises(ValueError, match="module:attribute"):
        lazy("no_colon")
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        lazy("lazy_target_mod:Nope")()


def test_create_turns_import_errors_into_unavailable() -> None:
    from pdcore.plugins import hookimpl

    class P:
        __name__ = "p"

        @hookimpl
        def pd_register_transfer_backends(self, register: Callable[..., None]) -> None:
            register("ghost", lazy("ghost_sdk_xyz.engine:Engine"))
            register("ghost2", lazy("ghost_sdk_xyz.engine:Engine"),
                     availability=importable("ghost_sdk_xyz.engine:E", install="pip install g"))

    reg = PluginHost(env={}, entry_points=[], extra=[P()]).registry(Kind.TRANSFER_BACKEND)
    with pytest.raises(UnavailableError, match="failed to import: No module named 'ghost_sdk_xyz'"):
        reg.create("ghost", None)
    with pytest.raises(UnavailableError, match="not found.*; pip install g"):
        reg.create("ghost2", None)


def registry_names() -> dict[str, list[str]]:
    return {k.value: r.names() for k, r in get_host().registries.items()}


def test_host_loads_in_spawned_process(fresh_host: None) -> None:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(registry_names)
    assert child == registry_names()
