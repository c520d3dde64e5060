"""The generated reference pages: docs/flags.md (from the parsers of `pdserve serve`, `router`
and `up`) and docs/environment.md (from pdcore/env_vars.py) are what `python -m
pdcore.docs_gen` writes now, and every environment variable named in the sources (core and
first-party plugins) is declared, so neither page can fall behind the code."""

from __future__ import annotations

import re
from pathlib import Path

from pdcore import docs_gen
from pdcore.env_vars import ENV_VARS, GLIBC, NOT_VARIABLES, PREFIXES

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\b(?:" + "|".join(PREFIXES) + r")[A-Z0-9][A-Z0-9_]*")


def test_generated_pages_are_current(monkeypatch) -> None:
    # the checkout's docs/, also when pdcore is installed from a wheel (as in CI)
    monkeypatch.setattr(docs_gen, "DOCS", ROOT / "docs")
    assert docs_gen.main(["--check"]) == 0, (
        "docs/flags.md or docs/environment.md is stale: run `python -m pdcore.docs_gen` "
        "(a flag or a variable changed)")


def test_the_flag_tables_list_every_command_and_flag() -> None:
    text = docs_gen.flags_md()
    for flag in ("`--model-path`, `--model`", "`--disaggregation-mode`",
                 "`--speculative-algorithm`", "`--pd-disaggregation`", "`--server-port-base`"):
        assert flag in text
    serve_flags = [r[0] for r in docs_gen.serve_rows()]
    assert len(serve_flags) == len(set(serve_flags)) > 50


def _source_names() -> dict[str, Path]:
    found: dict[str, Path] = {}
    files = [*(ROOT / "pdcore").rglob("*.py"), *(ROOT / "plugins").glob("pd-*/src/**/*.py")]
    for path in files:
        if path.name == "env_vars.py":
            continue
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, path)
    return found


def test_every_variable_in_the_sources_is_declared() -> None:
    declared = {v.name for v in ENV_VARS}
    assert len(declared) == len(ENV_VARS), "a variable is declared twice"
    found = _source_names()
    missing = {n: str(p.relative_to(ROOT)) for n, p in found.items()
               if n not in declared and n not in NOT_VARIABLES}
    assert not missing, ("declare these in pdcore/env_vars.py (name, default, meaning), then "
                         f"run `python -m pdcore.docs_gen`: {missing}")
    text = "".join(p.read_text(encoding="utf-8") for p in set(found.values()))
    # read as prefix + "REST" (config.DisaggEnv): the rest appears as a string of its own
    unread = {n for n in declared - set(found) - set(GLIBC)
              if not any(n.startswith(p) and f'"{n[len(p):]}"' in text for p in NOT_VARIABLES)}
    assert not unread, f"declared in pdcore/env_vars.py but read nowhere: {unread}"
