"""Every hookspec is documented in docs/plugin-hooks.md and exercised by some test."""

from __future__ import annotations

import re
from pathlib import Path

from pdcore.plugins import hookspecs
from pdcore.plugins.host import HOOKS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugin-hooks.md"


def hook_names() -> list[str]:
    return sorted(n for n, f in vars(hookspecs).items()
                  if n.startswith("pd_") and callable(f) and hasattr(f, "pdcore_spec"))


def collect_test_texts() -> dict[Path, str]:
    me = Path(__file__).resolve()
    files = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("plugins/*/tests/**/*.py")]
    return {f: f.read_text(errors="replace") for f in files if f.resolve() != me}


def missing(hooks: list[str], doc: str, tests: dict[Path, str]) -> dict[str, list[str]]:
    """hook -> what it lacks ("doc heading", "test")."""
    out: dict[str, list[str]] = {}
    for hook in hooks:
        lacks = []
        if not re.search(rf"^#+ .*\b{hook}\b", doc, flags=re.MULTILINE):
            lacks.append("doc heading")
        if not any(re.search(rf"\b{hook}\b", text) for text in tests.values()):
            lacks.append("test")
        if lacks:
            out[hook] = lacks
    return out


def test_hookspecs_found_and_each_has_a_registry() -> None:
    assert hook_names(), "no pd_* hookspecs found"
    assert sorted(HOOKS.values()) == hook_names()


def test_every_hook_documented_and_tested() -> None:
    assert missing(hook_names(), DOC.read_text(), collect_test_texts()) == {}


def test_check_fails_for_an_undocumented_untested_hook() -> None:
    hooks = [*hook_names(), "pd_register_imaginary_things"]
    assert missing(hooks, DOC.read_text(), collect_test_texts()) == {
        "pd_register_imaginary_things": ["doc heading", "test"]}
