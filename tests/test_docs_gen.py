"""The generated reference pages: docs/flags.md (from the parsers of `pdserve serve`, `router`
and `up`) and docs/environment.md (from pdcore/env.py's declarations) are what `python -m
pdcore.docs_gen` writes now, and every environment variable named in the sources (core and
first-party plugins) is declared, so neither page can fall behind the code."""

from __future__ import annotations

import re
from pathlib import Path

from pdcore import docs_gen
from pdcore.env import declared

# names in the sources that look like variables but are not (prefixes, constants, error codes)
NOT_VARIABLES = frozenset({
    "SGLANG_DISAGGREGATION_", "SGLANG_DISAGG_", "SGLANG_DISAGG_STAGING_POOL_", "MOONCAKE_POOLS",
    "MOONCAKE_VAR", "NIXL_ERRORS", "NIXL_ERR_BACKEND", "NIXL_ERR_INVALID_PARAM",
    "NIXL_ERR_NOT_FOUND", "NIXL_ERR_REMOTE_DISCONNECT", "NIXL_MEM",
})
# the prefixes a variable of ours (or of a library we configure) starts with
PREFIXES = ("PDCORE_", "PDSERVE_", "SGLANG_", "MOONCAKE_", "MC_", "ASCEND_", "NIXL_",
            "ENABLE_ASCEND_", "DISAGGREGATION_")

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
        if path.relative_to(ROOT).as_posix() == "pdcore/env.py":
            continue
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, path)
    return found


def test_every_variable_in_the_sources_is_declared() -> None:
    variables = list(declared())
    names = {v.name for v in variables}
    assert len(names) == len(variables), "a variable is declared twice"
    found = _source_names()
    missing = {n: str(p.relative_to(ROOT)) for n, p in found.items()
               if n not in names and n not in NOT_VARIABLES}
    assert not missing, ("declare these in pdcore/env.py (a typed field: default, parser, "
                         f"meaning), then run `python -m pdcore.docs_gen`: {missing}")
    files = [*(ROOT / "pdcore").rglob("*.py"), *(ROOT / "plugins").glob("pd-*/src/**/*.py")]
    text = "".join(p.read_text(encoding="utf-8") for p in files
                   if p.relative_to(ROOT).as_posix() != "pdcore/env.py")
    # read as a field (ENV.x, Env(m).x), by name from a mapping handed over (a backend's
    # settings, a library's variable), or as prefix + "REST" (a plugin's settings)
    unread = {v.name for v in variables
              if f".{v.attr}" not in text and f'"{v.name}"' not in text and v.name not in found
              and not any(v.name.startswith(p) and f'"{v.name[len(p):]}"' in text
                          for p in NOT_VARIABLES)}
    assert not unread, f"declared in pdcore/env.py but read nowhere: {unread}"
