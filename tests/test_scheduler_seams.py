"""#46 item 4: the scheduler's seams are held by its public surface, not by rules of conduct.

- Outside `engine/sched/`, code that holds a scheduler (a name or attribute `sched` /
  `scheduler`, and local aliases of one) uses only its public surface: the public methods and
  properties of `Scheduler`, of `SchedulerAPI` (what a role extension may do) and of
  `RuntimeAPI` (what the runtime may do). Its fields (queues, config, runner, speculator,
  extension, clock, outbox) and private names are off limits, read or written.
- Outside `engine/sched/`, nothing writes a request's page-holding fields (`pages`, `ctx_slots`,
  `num_computed`): a request's pages change only through `SchedulerAPI` (or the scheduler).

Read with ast: nothing is imported or run. The checker is shown to catch what it forbids.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PDCORE = ROOT / "pdcore"
SCHED = PDCORE / "engine" / "sched"

# (file under engine/sched, class): together, the scheduler's public surface
SURFACES = (("scheduler.py", "Scheduler"), ("api.py", "SchedulerAPI"),
            ("runtime_api.py", "RuntimeAPI"))
OWNERS = {"sched", "scheduler", "_sched", "_scheduler"}
PAGE_FIELDS = {"pages", "ctx_slots", "num_computed"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
# writes of a `pages` field that are not a request's: (module, owner expression) -> what it is
NOT_A_REQUEST = {
    ("pdcore/engine/kv/radix.py", "node"): "a prefix-cache tree node's pages (engine/kv)",
}


@cache
def surface() -> frozenset[str]:
    """The public methods and properties of the three classes, less every name the scheduler
    keeps as a field (`self.tp = ...`): a field read off a Scheduler is never API, even where
    an API class has a property of the same name."""
    names: set[str] = set()
    fields: set[str] = set()
    for file, cls in SURFACES:
        tree = ast.parse((SCHED / file).read_text())
        found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        assert found, f"engine/sched/{file} lost class {cls} (update SURFACES)"
        names |= {f.name for f in found[0].body
                  if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and not f.name.startswith("_")}
        if cls == "Scheduler":
            fields = {n.attr for n in ast.walk(found[0]) if isinstance(n, ast.Attribute)
                      and isinstance(n.ctx, ast.Store) and ast.unparse(n.value) == "self"}
    assert {"running", "waiting", "tp", "ext"} <= fields, "Scheduler's fields not found"
    return frozenset(names - fields)


@cache
def _modules() -> dict[str, ast.Module]:
    """Every module of pdcore and the plugins outside engine/sched, parsed."""
    paths = sorted(PDCORE.rglob("*.py")) + sorted((ROOT / "plugins").glob("*/src/**/*.py"))
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text())
            for p in paths if SCHED not in p.parents}


def _is_owner(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in OWNERS or node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr in OWNERS


def scheduler_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of every attribute taken of a scheduler (getattr & co. included)."""
    out: list[tuple[int, str]] = []
    scopes = [n for n in ast.walk(tree)
              if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        body = list(ast.walk(scope))
        aliases: set[str] = set()
        for n in body if not isinstance(scope, ast.Module) else []:
            # `s = self.sched`: s is a scheduler within this function
            if isinstance(n, ast.Assign) and _is_owner(n.value, aliases):
                aliases |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for n in body:
            if isinstance(n, ast.Attribute) and _is_owner(n.value, aliases):
                out.append((n.lineno, n.attr))
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and len(n.args) > 1 and _is_owner(n.args[0], aliases)
                  and isinstance(n.args[1], ast.Constant)):
                out.append((n.lineno, str(n.args[1].value)))
    return sorted(set(out))


def off_surface(tree: ast.AST) -> list[str]:
    allowed = surface()
    return [f"{line}: .{attr}" for line, attr in scheduler_uses(tree) if attr not in allowed]


def _page_field(t: ast.AST) -> ast.Attribute | None:
    while isinstance(t, ast.Subscript):
        t = t.value
    return t if isinstance(t, ast.Attribute) and t.attr in PAGE_FIELDS else None


def page_writes(tree: ast.AST, module: str = "") -> list[str]:
    """Writes of a page-holding field of an object other than `self` (assigned, augmented,
    deleted, an element set, or changed by a list method)."""
    out = []
    for n in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(n, ast.Assign):
            targets = list(n.targets)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        elif isinstance(n, ast.Delete):
            targets = list(n.targets)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr in MUTATORS):
            targets = [n.func.value]
        flat = [e for t in targets
                for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        for t in flat:
            f = _page_field(t.value if isinstance(t, ast.Starred) else t)
            if f is None:
                continue
            owner = ast.unparse(f.value)
            if owner != "self" and (module, owner) not in NOT_A_REQUEST:
                out.append(f"{n.lineno}: {ast.unparse(t)}")
    return out


def test_outside_engine_sched_a_scheduler_is_used_through_its_public_surface() -> None:
    bad, seen = [], set()
    for rel, tree in _modules().items():
        if scheduler_uses(tree):
            seen.add(rel)
        bad += [f"{rel}:{b}" for b in off_surface(tree)]
    # the walk finds the modules that drive or extend a scheduler (else it checks nothing)
    for must in ("pdcore/runtime/lockstep.py", "pdcore/runtime/scheduler_process.py",
                 "pdcore/disagg/decode/sched.py", "pdcore/disagg/prefill/sched.py"):
        assert must in seen, f"{must}: no scheduler use found; the checker lost track of it"
    assert not bad, ("scheduler fields or private names used outside engine/sched (add a "
                     "method to SchedulerAPI or RuntimeAPI that says what it does):\n"
                     + "\n".join(bad))


def test_outside_engine_sched_nothing_writes_a_requests_pages() -> None:
    bad = []
    for rel, tree in _modules().items():
        bad += [f"{rel}:{b}" for b in page_writes(tree, rel)]
    assert not bad, ("a request's pages written outside engine/sched (use SchedulerAPI: "
                     "extend_pages, drop_pages, take_pages, attach_prefix):\n" + "\n".join(bad))


def test_the_checkers_catch_what_they_forbid() -> None:
    """What the runtime and the decode extension did before #46 item 4, one line each."""
    runtime = ast.parse(
        "class Loop:\n"
        "    def run(self):\n"
        "        s = self.sched\n"
        "        x = len(self.sched.running) + len(s.waiting)\n"
        "        self.sched.step_time = 1.0\n"
        "        g = getattr(self.sched.runner, 'grammar', None)\n"
        "        engine.scheduler.ext = ext\n"
        "        sched._poll()\n"
        "        n = sched.tp.size\n"
        "        self.sched.step()\n")
    assert [b.split(": ")[1] for b in off_surface(runtime)] == [
        ".running", ".waiting", ".step_time", ".runner", ".ext", "._poll", ".tp"]
    decode = ast.parse(
        "def reserve(req, sched, pages, k):\n"
        "    req.pages += sched.extend_pages(req, 3)\n"
        "    req.pages = []\n"
        "    req.pages[0] = 5\n"
        "    del req.pages[k:]\n"
        "    req.pages.extend(pages)\n"
        "    req.num_computed, req.ctx_slots = 4, None\n"
        "    self.pages = []\n"
        "    n = len(req.pages)\n")
    assert sorted(int(b.split(":")[0]) for b in page_writes(decode)) == [2, 3, 4, 5, 6, 7, 7]
    assert {"extend_pages", "take_pages", "drop_pages", "submit", "step_due"} <= surface()
    assert not {"running", "waiting", "cfg", "runner", "ext", "spec", "tp"} & surface()
