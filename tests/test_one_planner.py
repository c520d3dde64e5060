"""#46 item 2: one request planner, and one place that sets max_new_tokens.

`pdcore/server/planner.py` decides every request's max_new_tokens (`max_new_tokens`) and one
statement of it writes the field (`_limit`): the client's requests (`plan`), the requests the
server makes itself (`plan_probe`: the warm-up, /health_generate), and a prefill server's "one
token", decided from the server's role, so P's scheduler receives it set and only refuses a
request planned elsewhere. The AST scan below holds it for pdcore and the first-party plugins
(every spelling of a write: an attribute or subscript assignment, a keyword argument, a dict
key, setattr); `pdcore/testing` is left out: it is the test kit, a client that asks for tokens
as curl does. Readers and the declarations of the field (dataclass and schema fields) are not
writes."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from pdcore.config import ServerArgs
from pdcore.disagg.prefill.sched import PrefillExtension
from pdcore.edge.schemas import GenerateRequest
from pdcore.engine.sched.request import Req
from pdcore.messages.info import EngineInfo
from pdcore.messages.io import GenerateReq, PDRoute, SamplingParams
from pdcore.route_auth import RouteGuard
from pdcore.server import planner
from pdcore.server.native_routes import generate_input
from pdcore.server.params import PDInfo

ROOT = Path(__file__).resolve().parent.parent
FIELD = "max_new_tokens"
THE_PLACE = ("pdcore/server/planner.py", "_limit")


def _writes(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing function) of every write of max_new_tokens in the file."""
    source = path.read_text(encoding="utf-8")
    if FIELD not in source:
        return []
    tree = ast.parse(source, str(path))
    where: dict[ast.AST, str] = {}

    def visit(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else fn
            where[child] = name
            visit(child, name)

    visit(tree, "<module>")

    def named(t: ast.AST) -> bool:
        if isinstance(t, (ast.Tuple, ast.List)):
            return any(named(e) for e in t.elts)
        if isinstance(t, ast.Starred):
            return named(t.value)
        if isinstance(t, ast.Attribute):
            return t.attr == FIELD
        return isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) \
            and t.slice.value == FIELD

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
            targets = [node.target]
        hit = any(named(t) for t in targets)
        if isinstance(node, ast.Call):
            hit = hit or any(k.arg == FIELD for k in node.keywords) or (
                isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == FIELD)
        if isinstance(node, ast.Dict):
            hit = hit or any(isinstance(k, ast.Constant) and k.value == FIELD
                             for k in node.keys)
        if hit:
            found.append((node.lineno, where.get(node, "<module>")))
    return found


def test_one_statement_in_pdcore_sets_max_new_tokens() -> None:
    files = [p for p in (ROOT / "pdcore").rglob("*.py")
             if "testing" not in p.relative_to(ROOT / "pdcore").parts[:1]]
    files += ROOT.glob("plugins/pd-*/src/**/*.py")
    writes = [(str(p.relative_to(ROOT)), fn, line) for p in files for line, fn in _writes(p)]
    assert [(f, fn) for f, fn, _ in writes] == [THE_PLACE], (
        "max_new_tokens is decided by pdcore/server/planner.py (max_new_tokens) and written by "
        f"its _limit only; plan a request there instead of setting the field: {writes}")


def test_the_scan_catches_each_spelling(tmp_path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "class S:\n    max_new_tokens: int = 4\n"  # a declaration: not a write
        "def f(sp, d, n):\n"
        "    print(sp.max_new_tokens)\n"  # a read: not a write
        "    sp.max_new_tokens = 1\n    sp.max_new_tokens += 1\n    d['max_new_tokens'] = 2\n"
        "    a, sp.max_new_tokens = 1, 2\n    S(max_new_tokens=3)\n"
        "    setattr(sp, 'max_new_tokens', 4)\n    return {'max_new_tokens': n}\n")
    assert [line for line, _ in _writes(src)] == [5, 6, 7, 8, 9, 10, 11]
    assert {fn for _, fn in _writes(src)} == {"f"}


# ---- the planner decides P's one token from the server's role --------------------------------
def _engine(mode: str) -> SimpleNamespace:
    args = ServerArgs(disaggregation_mode=mode, disaggregation_bootstrap_port=8998)
    return SimpleNamespace(args=args, info=EngineInfo(context_length=4096,
                                                      max_total_tokens=8192, vocab_size=100))


def test_a_prefill_server_plans_one_token_whatever_the_client_asks() -> None:
    guard = RouteGuard(trusted="127.0.0.1:9000")
    for mode, want in (("prefill", [1, 1]), ("decode", [300, 7])):
        body = GenerateRequest(input_ids=[[1, 2, 3], [4, 5]], bootstrap_host="127.0.0.1",
                               bootstrap_port=9000, bootstrap_room=[11, 12],
                               sampling_params=[{"max_new_tokens": 300}, {"max_new_tokens": 7}])
        plan = planner.plan(generate_input(body, _engine(mode)), _engine(mode), guard)
        assert [i.req.sampling.max_new_tokens for i in plan.items] == want, mode
    for mode in ("null", "prefill", "decode"):  # the server's own requests: one token
        req = planner.plan_probe("warmup-x", [1, 2, 3, 4], _engine(mode), PDInfo())
        assert req.sampling.max_new_tokens == 1 and req.sampling.temperature == 0.0
        assert req.sampling.ignore_eos


def test_the_prefill_scheduler_refuses_a_request_planned_elsewhere() -> None:
    """P's scheduler no longer sets max_new_tokens: a request asking for more than one token
    (built by hand, past the planner) is refused with 400, naming what happened; one token is
    admitted."""
    failed: list[tuple[str, str, int]] = []
    held: list[str] = []
    sched = SimpleNamespace(fail=lambda req, msg, status=500, code=None: failed.append(
        (req.rid, msg, status)), running=[], waiting=[])
    mgr = SimpleNamespace(add=lambda room, host: None, role="prefill")
    ext = PrefillExtension(sched, mgr, aux=None)
    ext.sched.hold = lambda req: held.append(req.rid)
    route = PDRoute(host="127.0.0.1", port=9000, room=5)
    for rid, n in (("many", 16), ("one", 1)):
        msg = GenerateReq(rid, [1, 2, 3], SamplingParams(max_new_tokens=n), route=route)
        assert ext.admit(Req.from_generate(msg))
    assert [(r, s) for r, _, s in failed] == [("many", 400)], failed
    assert "asks for 16 (max_new_tokens)" in failed[0][1] and "planner" in failed[0][1]
    assert held == ["one"] and ext.counts["requests"] == 1


def test_every_request_the_http_process_makes_is_planned_by_the_planner() -> None:
    """#46: plan_request and plan_generate became one function (`planner.plan`); every engine
    request of the HTTP process (the routes', the warm-up's, /health_generate's) is built by
    the planner: no other module of pdcore/server or pdcore/edge calls make_req or constructs
    a GenerateReq (params.make_req itself aside), and no plan_request / plan_generate is
    left."""
    builders = {"make_req", "GenerateReq"}
    calls, defs = [], []
    for p in [*(ROOT / "pdcore" / "server").rglob("*.py"),
              *(ROOT / "pdcore" / "edge").rglob("*.py")]:
        rel = str(p.relative_to(ROOT))
        tree = ast.parse(p.read_text(encoding="utf-8"), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in builders:
                calls.append(rel)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
                    "plan_request", "plan_generate"):
                defs.append(f"{rel}:{node.name}")
    assert sorted(set(calls)) == ["pdcore/server/params.py", "pdcore/server/planner.py"], calls
    assert calls.count("pdcore/server/params.py") == 1  # make_req's own GenerateReq
    assert not defs, defs
