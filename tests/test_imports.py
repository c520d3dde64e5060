"""Every module of pdcore and of every installed pdcore plugin imports in this environment, and
every third-party package their code imports is declared in their own metadata.

Run in an environment built only from declared metadata (scripts/test.sh), the first test fails
when a dependency is missing; the second fails even where the machine happens to have the
package, e.g. one that only arrives as a dependency of a dependency."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import pkgutil
import re
import sys
from pathlib import Path

import pytest

# module -> (the SDK its ImportError must name, why it cannot import without it). None today:
# every module imports its hardware SDK lazily, inside the function that needs it.
NEEDS_HARDWARE_SDK: dict[str, tuple[str, str]] = {}


def _plugin_packages() -> dict[str, str]:
    """Top-level package -> distribution, for pdcore and every installed pdcore plugin."""
    found = {"pdcore": "pdcore"}
    for ep in md.entry_points(group="pdcore"):
        top = ep.value.split(":")[0].split(".")[0]
        found.setdefault(top, ep.dist.name if ep.dist is not None else top)
    return found


PACKAGES = _plugin_packages()


def _modules(top: str) -> list[str]:
    package = importlib.import_module(top)
    names = [top]
    for info in pkgutil.walk_packages(package.__path__, top + ".",
                                      onerror=lambda name: names.append(name)):
        names.append(info.name)
    return sorted(set(names))


MODULES = [m for top in sorted(PACKAGES) for m in _modules(top)]


@pytest.mark.parametrize("module", MODULES)
def test_module_imports(module: str) -> None:
    if module not in NEEDS_HARDWARE_SDK:
        importlib.import_module(module)
        return
    sdk, why = NEEDS_HARDWARE_SDK[module]
    try:
        importlib.import_module(module)
    except ImportError as e:
        assert sdk in str(e), f"{module} needs {sdk} ({why}) but failed with: {e!r}"


def test_hardware_list_names_real_modules() -> None:
    stale = [m for m in NEEDS_HARDWARE_SDK if m.split(".")[0] in PACKAGES and m not in MODULES]
    assert not stale, f"NEEDS_HARDWARE_SDK lists modules that do not exist: {stale}"


def test_every_installed_plugin_is_walked() -> None:
    # the walk must reach each package's own modules, not only its __init__
    for top in PACKAGES:
        assert any(m.startswith(top + ".") for m in MODULES), f"no modules found under {top}"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports(root: Path, local: set[str]) -> dict[str, str]:
    """Top-level module -> one file importing it, over every .py file under `root`, leaving out
    the standard library and `local` names (function-level imports included: an optional SDK
    still needs a declared extra)."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                first = name.split(".")[0]
                if first not in sys.stdlib_module_names and first not in local:
                    found.setdefault(first, str(path.relative_to(root.parent)))
    return found


def _undeclared(dist: str, imports: dict[str, str]) -> list[str]:
    declared = set()
    for req in md.requires(dist) or []:  # every extra counts: optional SDKs live in extras
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if match:
            declared.add(_norm(match.group(1)))
    providers = md.packages_distributions()
    missing = []
    for module, where in sorted(imports.items()):
        # an installed module maps to its distribution(s); one not installed here (an optional
        # hardware SDK) has to be declared under its own name
        dists = {_norm(d) for d in providers.get(module, [])} or {_norm(module)}
        if not dists & declared:
            missing.append(f"{module} (imported by {where}; provided by "
                           f"{', '.join(sorted(dists))})")
    return missing


@pytest.mark.parametrize("top", sorted(PACKAGES))
def test_imports_are_declared(top: str) -> None:
    root = Path(importlib.import_module(top).__file__ or "").parent
    missing = _undeclared(PACKAGES[top], _third_party_imports(root, {top}))
    assert not missing, f"{PACKAGES[top]} does not declare: {'; '.join(missing)}"


def test_core_test_imports_are_declared() -> None:
    """What the core tests import comes from pdcore's own metadata (its test extra)."""
    tests = Path(__file__).resolve().parent
    local = {p.stem for p in tests.rglob("*.py")} | {p.name for p in tests.rglob("*")
                                                      if p.is_dir()}
    local |= {p.stem for p in (tests.parent / "bench").glob("*.py")}  # bench tests import them
    missing = _undeclared("pdcore", _third_party_imports(tests, local | {"pdcore"}))
    assert not missing, f"pdcore does not declare what its tests import: {'; '.join(missing)}"
