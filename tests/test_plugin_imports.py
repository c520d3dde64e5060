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
