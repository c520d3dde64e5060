"""The import rules of docs/architecture.md hold for every module of pdcore.

The imports are read with ast (every `import` and `from ... import`, inside functions and under
TYPE_CHECKING too), so the check needs nothing installed. Two kinds of rules:
- the layer table of docs/architecture.md, parsed from the document itself, so the document and
  the code cannot drift apart: every package of pdcore has one row, and imports only what its
  row allows;
- the rules the architecture issue set (below, fixed here, so relaxing the document cannot
  relax them): the engine imports nothing above it, the protocol no builtin and no plugin, core
  no plugin distribution, the server imports the runtime's package, none of its modules, and
  nothing of engine/sched or engine/model, the router nothing of the server
  (that the runtime and the role extensions use the scheduler's public surface only, and
  write no request's pages: tests/test_scheduler_seams.py).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PDCORE = ROOT / "pdcore"
DOC = ROOT / "docs" / "architecture.md"
PLUGINS = ROOT / "plugins"


def _unit(module: str) -> str:
    """`pdcore.engine.sched.scheduler` -> `engine`; `pdcore.cli` -> `cli`."""
    return module.split(".")[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@cache
def imports() -> dict[str, list[tuple[int, str]]]:
    """module -> [(line, imported module)] for every module of pdcore."""
    out: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(PDCORE.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: list[tuple[int, str]] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:  # `from pdcore.builtin import shm_segment`: a module
                    sub = f"{base}.{a.name}"
                    found.append((node.lineno, sub if _is_module(sub) else base))
        out[name] = found
    return out


def units() -> set[str]:
    return {_unit(m) for m in imports() if m != "pdcore"}


def internal(module: str) -> list[tuple[int, str]]:
    """The pdcore modules `module` imports outside its own unit."""
    own = _unit(module)
    return [(line, m) for line, m in imports()[module]
            if m.startswith("pdcore.") and _unit(m) != own]


def _plugin_packages() -> set[str]:
    return {p.name for src in PLUGINS.glob("*/src") for p in src.iterdir()
            if (p / "__init__.py").exists()}


def _check(bad: list[tuple[str, str, int]], message: str) -> None:
    """Fail on `bad`: (module, imported module, line) triples."""
    assert not bad, message + "\n" + "\n".join(f"{m}:{line} imports {imp}"
                                               for m, imp, line in bad)


# ---- the layer table of docs/architecture.md ----------------------------------------------------
@cache
def layer_table() -> dict[str, set[str] | None]:
    """unit -> the pdcore modules/units it may import (None: any unit of a lower row)."""
    text = DOC.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    assert rows, "docs/architecture.md lost its layer table"
    table: dict[str, set[str] | None] = {}
    for row in rows:
        packages, may = (c.strip() for c in row.strip().strip("|").split("|")[1:3])
        packages, may = (re.sub(r"\([^)]*\)", "", c) for c in (packages, may))  # asides
        names = [n.rstrip("/") for n in re.findall(r"`([^`]+)`", packages)]
        if "anything below" in may:
            allowed = None
        else:
            allowed = {n.rstrip("/") for n in re.findall(r"`([^`]+)`", may)}
        for n in names:
            assert n not in table, f"{n} has two rows in the layer table"
            table[n] = allowed
    return table


def test_every_package_has_a_row_in_the_layer_table() -> None:
    missing = sorted(units() - set(layer_table()))
    assert not missing, f"pdcore packages with no row in docs/architecture.md: {missing}"
    stale = sorted(set(layer_table()) - units())
    assert not stale, f"rows of docs/architecture.md with no package in pdcore: {stale}"


def _allowed(allowed: set[str], module: str) -> bool:
    """`engine` allows every module of engine; `edge.limits` that module alone."""
    rest = module.removeprefix("pdcore.")
    return any(rest == a or rest.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("unit", sorted(units()))
def test_imports_follow_the_layer_table(unit: str) -> None:
    allowed = layer_table().get(unit)
    if allowed is None:  # the top layer (entry points): anything below
        return
    bad = [(m, imp, line) for m in imports() if m != "pdcore" and _unit(m) == unit
           for line, imp in internal(m) if not _allowed(allowed, imp)]
    _check(bad, f"{unit} may import only {sorted(allowed)} (docs/architecture.md):")


MAX_CONCEPT_ROW = 400


def test_the_concept_table_has_rows_a_reader_can_read() -> None:
    """#46: "where each concept lives" is read row by row; a row past 400 characters is a
    paragraph in a cell (its detail belongs in the topic page it names, or in a row of its own).
    Every table of the section counts, whatever its sub-headings."""
    text = DOC.read_text()
    assert "## Where each concept lives" in text, "docs/architecture.md lost its concept table"
    section = text.split("## Where each concept lives", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line)]
    assert len(rows) > 20, "the concept tables lost their rows"
    long = [f"{len(r)} chars: {r[:80]}..." for r in rows if len(r) > MAX_CONCEPT_ROW]
    assert not long, (f"concept rows over {MAX_CONCEPT_ROW} characters (split the concept, or "
                      "move the detail to its topic page):\n" + "\n".join(long))


# ---- the rules of the architecture step --------------------------------------------------------
def _violations(unit: str, forbidden: set[str]) -> list[tuple[str, str, int]]:
    return [(m, imp, line) for m in imports() if m != "pdcore" and _unit(m) == unit
            for line, imp in internal(m) if _unit(imp) in forbidden]


def test_the_engine_imports_nothing_above_it() -> None:
    _check(_violations("engine", {"disagg", "server", "router", "builtin", "runtime"}),
           "the engine imports a layer above it:")


# the engine's own folders, lowest first: kv/ (pool, pages, prefix cache) and model/ (the forward
# pass, `ModelRunner`) know no request; sched/ (queues, requests, sampling, the step) is above
# them. #46: no arrow from engine/model or engine/kv to engine/sched.
ENGINE_BELOW_SCHED = ("pdcore.engine.model", "pdcore.engine.kv", "pdcore.engine.parallel")


def test_engine_model_and_kv_import_nothing_of_sched() -> None:
    bad = [(m, imp, line) for m in imports() if m.startswith(ENGINE_BELOW_SCHED)
           for line, imp in imports()[m]
           if imp == "pdcore.engine.sched" or imp.startswith("pdcore.engine.sched.")]
    _check(bad, "engine/model, engine/kv and engine/parallel import engine/sched (the request, "
                "the sampler, the step live above them: hand them tensors or a protocol):")


# #46: the step loop (engine/loop.py) owns the scheduler, the runner and the speculator; the
# scheduler decides what runs and never runs a model or drafts (it reads the runner's results,
# batch_run.StepResult, as a type only)
NOT_IN_THE_SCHEDULER = ("pdcore.engine.model.runner",
                        "pdcore.engine.sched.speculative", "pdcore.engine.sched.eagle",
                        "pdcore.engine.sched.drafter", "pdcore.engine.loop")


def test_the_scheduler_holds_no_runner_and_no_speculator() -> None:
    bad = [(m, imp, line) for m in ("pdcore.engine.sched.scheduler",)
           for line, imp in imports()[m] if imp in NOT_IN_THE_SCHEDULER]
    _check(bad, "the scheduler imports the runner's or the speculator's side (the step loop, "
                "engine/loop.py, joins them):")
    tree = ast.parse((PDCORE / "engine" / "sched" / "scheduler.py").read_text())
    held = [f"line {n.lineno}: self.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and n.attr in ("runner", "spec", "model", "drafter")]
    assert not held, f"engine/sched/scheduler.py holds the model side: {held}"
    # what a role extension reads of the model side is data (ModelSide, HeadChain): neither
    # the scheduler's API nor the extension contract reaches the speculator or a draft head
    reach = []
    for name in ("api.py", "extension.py"):
        tree = ast.parse((PDCORE / "engine" / "sched" / name).read_text())
        reach += [f"{name}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and any(
                      a.name in ("HeadDrafter", "Speculator", "ModelRunner") for a in n.names)
                  or isinstance(n, ast.Attribute) and n.attr in ("drafter", "head")]
    assert not reach, f"the scheduler's side reaches the speculator or a draft head: {reach}"


def test_draft_heads_run_through_the_model_runner() -> None:
    """#46: "where does the model run?" has one answer: the drafters feed their head's passes
    to ModelRunner.forward_draft and take its logits from ModelRunner.draft_logits, never call
    the head module (or its logits) themselves."""
    bad = []
    for name in ("eagle.py", "mtp_chain.py", "drafter.py", "speculative.py"):
        tree = ast.parse((PDCORE / "engine" / "sched" / name).read_text())
        bad += [f"{name}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Call)
                and ast.unparse(n.func) in ("self.head", "head", "self.model")]
        bad += [f"{name}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and n.attr == "logits" and ast.unparse(n.value) in ("self.head", "head")]
    assert not bad, f"a draft head's pass outside the model runner: {bad}"


def test_kv_imports_no_model() -> None:
    """The KV pool and pages sit below the model: the model writes into them, not back."""
    bad = [(m, imp, line) for m in imports() if m.startswith("pdcore.engine.kv")
           for line, imp in imports()[m] if imp.startswith("pdcore.engine.model")]
    _check(bad, "engine/kv imports engine/model:")


def test_the_router_imports_nothing_of_the_server() -> None:
    """#46: the gates the router and the servers share (schemas, limits, auth, the connection
    gate, tracing) live in `pdcore/edge/`; the router runs no module of the server."""
    _check(_violations("router", {"server"}), "the router imports the server (what both need "
                                              "belongs in pdcore/edge/):")


def test_the_server_imports_no_scheduler_and_no_model() -> None:
    """#46: the HTTP process parses a request's grammar with `constrained.spec`, reads stats as
    `messages.stats`, and asks the runtime's package where the model is: it imports nothing of
    engine/sched (the scheduler process's requests, sampler, step) nor of engine/model."""
    below = ("pdcore.engine.sched", "pdcore.engine.model")
    bad = [(m, imp, line) for m in imports() if m != "pdcore" and _unit(m) == "server"
           for line, imp in imports()[m]
           if any(imp == b or imp.startswith(b + ".") for b in below)]
    _check(bad, "the server imports engine/sched or engine/model (requests and grammars: "
                "pdcore.messages, pdcore.constrained; the model's files: pdcore.runtime):")


def test_the_grammar_spec_is_pure_python() -> None:
    """#46: the HTTP process checks a request's grammar with `constrained.spec` and must not
    load xgrammar or torch for it (they belong to the scheduler process's `constrained.backend`):
    the spec imports the standard library, `errors` and `messages` only."""
    import sys

    spec = "pdcore.constrained.spec"
    bad = [(spec, imp, line) for line, imp in imports()[spec]
           if not (imp.split(".")[0] in sys.stdlib_module_names or imp == "__future__"
                   or imp.startswith(("pdcore.errors", "pdcore.messages")))]
    _check(bad, "constrained/spec.py imports beyond the standard library, errors and messages:")


def test_the_server_uses_the_runtime_through_its_package_only() -> None:
    """#34: the server sees the runtime through `pdcore.runtime`'s exports (the engine handle,
    `make_engine`, the parallel-flag checks, `run_node`), never through one of its modules."""
    bad = [(m, imp, line) for m in imports() if m != "pdcore" and _unit(m) == "server"
           for line, imp in imports()[m] if imp.startswith("pdcore.runtime.")]
    _check(bad, "the server imports a module of pdcore.runtime (import from pdcore.runtime):")


def test_the_messages_import_no_side() -> None:
    """#46: the types that cross processes live in a neutral package every side can import
    without importing another side (the engine, the protocol, the runtime, server or router)."""
    _check(_violations("messages", {"engine", "disagg", "runtime", "server", "router"}),
           "pdcore.messages imports one of the sides it connects:")


def test_the_protocol_imports_no_builtin() -> None:
    _check(_violations("disagg", {"builtin"}), "the protocol imports a builtin:")


def test_core_never_imports_a_plugin_distribution() -> None:
    plugins = _plugin_packages()
    assert plugins, "no plugin packages found under plugins/*/src"
    bad = [f"{m}:{line} imports {imp}" for m, found in imports().items() for line, imp in found
           if imp.split(".")[0] in plugins]
    assert not bad, "\n".join(bad)


def test_the_scheduler_has_no_role_branches() -> None:
    src = (PDCORE / "engine" / "sched" / "scheduler.py").read_text()
    tree = ast.parse(src)
    bad = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute)
           and n.attr in ("disagg", "route", "bootstrap_room", "bootstrap_host", "fork_of")]
    assert not bad, f"engine/sched/scheduler.py reads role state at lines {bad}"


def import_circles() -> list[list[str]]:
    """The strongly connected components (of two or more modules) of pdcore's import graph,
    imports inside functions and under TYPE_CHECKING included: a circle closed that way still
    ties the modules together."""
    graph = {m: {imp for _, imp in found if imp in imports() and imp != m}
             for m, found in imports().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    circles = import_circles()
    assert not circles, "import circles (break each by moving what both sides need below " \
        "them):\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_module_over_500_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(PDCORE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500]
    assert not long, "modules over 500 lines (split them by concern):\n" + "\n".join(long)


def test_no_class_over_300_lines() -> None:
    """#34: a class that grows past 300 lines holds more than one concern (the KV managers
    take theirs from modules of their own: prefill/chunks; decode/resolve and decode/peers as
    composed parts)."""
    long = []
    for p in sorted(PDCORE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and \
                    (n := node.end_lineno - node.lineno + 1) > 300:  # type: ignore[operator]
                long.append(f"{p.relative_to(ROOT)}: {node.name} {n}")
    assert not long, "classes over 300 lines (split them by concern):\n" + "\n".join(long)


MAX_POSITIONAL = 6


def test_no_function_takes_more_than_six_positional_parameters() -> None:
    """#46: a call of seven bare positional values is read by counting; past six, a function
    takes keyword-only parameters (after `*`) or one small dataclass. self/cls do not count."""
    roots = [PDCORE, *sorted(PLUGINS.glob("*/src"))]
    many = []
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
                if names and names[0] in ("self", "cls"):
                    names = names[1:]
                if len(names) > MAX_POSITIONAL:
                    many.append(f"{p.relative_to(ROOT)}:{node.lineno} "
                                f"{getattr(node, 'name', 'lambda')} {len(names)}")
    assert not many, (f"functions with more than {MAX_POSITIONAL} positional parameters (make "
                      "the rest keyword-only, or pass a dataclass):\n" + "\n".join(many))
