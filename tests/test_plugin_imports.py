"""First-party plugins are separate distributions: they import only pdcore's public modules (the
`plugins/pd-*` row of docs/architecture.md's layer table), never pdcore.builtin or the protocol's
internals. Read from the ast of every plugin module, so an import inside a function counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def public_modules() -> set[str]:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| — | `plugins/pd-*`"))
    public = row.split("public modules (", 1)[1].split(")", 1)[0]
    return set(re.findall(r"`([a-z_]+)`", public))


def pdcore_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "pdcore":  # from pdcore import builtin
                names = [f"pdcore.{a.name}" for a in node.names]
        found += [(node.lineno, n) for n in names if n == "pdcore" or n.startswith("pdcore.")]
    return found


def test_the_public_list_is_read_from_the_doc() -> None:
    assert {"interfaces", "backendkit", "plugins", "errors", "testing"} <= public_modules()


def test_plugins_import_only_public_pdcore_modules() -> None:
    public = public_modules()
    sources = sorted(ROOT.glob("plugins/pd-*/src/**/*.py"))
    assert len(sources) > 10, "plugin sources not found"
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
           for p in sources for line, name in pdcore_imports(p)
           if name == "pdcore" or name.split(".")[1] not in public]
    assert not bad, "plugins import pdcore internals:\n" + "\n".join(bad)


def test_sdk_probe_and_guarded_factory_say_what_is_missing(tmp_path, monkeypatch) -> None:
    """The probe pd-mooncake and pd-nixl register as their availability (pdcore.plugins.lazy)."""
    import pytest

    from pdcore.errors import UnavailableError
    from pdcore.plugins.lazy import guarded, sdk_probe

    (tmp_path / "needs_ghost_sdk.py").write_text("import ghost_sdk_h2.engine\n")
    (tmp_path / "broken_sdk_h2.py").write_text("raise OSError('libghost.so: cannot open')\n")
    (tmp_path / "uses_broken.py").write_text("import broken_sdk_h2\ndef create(x):\n    return x\n")
    (tmp_path / "fine_h2.py").write_text("def create(x):\n    return ('made', x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = sdk_probe("needs_ghost_sdk", "ghost-sdk", ("ghost_sdk_h2",), "pip install ghost",
                        "reinstall")
    assert missing() == (False, "ghost-sdk is not installed: pip install ghost")
    broken = sdk_probe("uses_broken", "broken-sdk", ("broken_sdk_h2",), "pip install b",
                       "missing system libraries?")
    ok, why = broken()
    assert not ok and why == ("broken-sdk failed to import (OSError: libghost.so: cannot open); "
                              "missing system libraries?")
    with pytest.raises(UnavailableError, match="transfer backend 'ghost' is not available here: "
                                               "ghost-sdk is not installed"):
        guarded("transfer backend", "ghost", missing, "needs_ghost_sdk:create")(1)
    fine = sdk_probe("fine_h2", "fine", ("fine_h2",), "", "")
    assert fine() == (True, "")
    assert guarded("transfer backend", "fine", fine, "fine_h2:create")(7) == ("made", 7)
