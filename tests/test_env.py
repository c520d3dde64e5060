"""#46 item 6: one typed environment object. `pdcore/env.py` is the only module of pdcore and of
the first-party plugins that touches `os.environ` / `getenv` (read or write; a child's
environment is `env.child_environ()`); every variable is a typed field read at each access; a bad
value is an EnvError naming the variable, which every entry point turns into exit 2 before it
loads anything."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdcore import env
from pdcore.env import ENV, Env, EnvError
from pdcore.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
ENV_MODULE = ROOT / "pdcore" / "env.py"
# os's environment API: the mapping (and its bytes twin) and the functions over it
OS_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _uses_of_the_environment(path: Path) -> list[str]:
    """Every `os.environ`/`os.getenv`/... attribute and `from os import environ/getenv/...` in
    the file (an alias of os, `import os as o`, counts too)."""
    source = path.read_text(encoding="utf-8")
    if not any(n in source for n in OS_NAMES):  # none of the names: nothing to parse
        return []
    tree = ast.parse(source, str(path))
    os_names = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname for a in node.names if a.name == "os" and a.asname}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in OS_NAMES
                and isinstance(node.value, ast.Name) and node.value.id in os_names):
            found.append(f"{node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{node.lineno}: from os import {a.name}" for a in node.names
                      if a.name in OS_NAMES]
    return found


def test_only_the_env_module_touches_the_environment() -> None:
    files = [*(ROOT / "pdcore").rglob("*.py"), *ROOT.glob("plugins/pd-*/src/**/*.py")]
    assert len(files) > 200 and ENV_MODULE in files
    bad = {str(p.relative_to(ROOT)): uses for p in files if p != ENV_MODULE
           for uses in [_uses_of_the_environment(p)] if uses}
    assert not bad, ("read variables through pdcore.env (ENV.<name>, Env(mapping).<name>; "
                     "declare a new one there), start children with env.child_environ(): "
                     f"{bad}")
    assert _uses_of_the_environment(ENV_MODULE), "the scan finds nothing: it is broken"


def test_the_scan_catches_each_spelling(tmp_path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os as o\nfrom os import getenv\nx = o.environ.get('A')\n"
                   "y = getenv('B')\no.putenv('C', '1')\n")
    assert len(_uses_of_the_environment(src)) == 3


def test_fields_are_typed_read_at_each_access_and_named_once(monkeypatch) -> None:
    names = [v.name for v in env.declared()]
    assert len(names) == len(set(names)) > 80
    monkeypatch.delenv("PDCORE_TP_TIMEOUT", raising=False)
    assert ENV.pdcore_tp_timeout == 600.0
    monkeypatch.setenv("PDCORE_TP_TIMEOUT", "7.5")  # no restart, no cache
    assert ENV.pdcore_tp_timeout == 7.5
    e = Env({"PDSERVE_HTTP_MAX_CONNECTIONS": "17", "PDCORE_NATIVE": "off",
             "SGLANG_DISAGG_STAGING_BUFFER": "True", "PDCORE_MAX_REQUEST_BYTES": " "})
    assert e.pdserve_http_max_connections == 17 and e.pdcore_native is False
    assert e.sglang_disagg_staging_buffer is True
    assert e.pdcore_max_request_bytes == 4 << 20  # blank: the default
    assert Env.pdcore_tp_timeout.name == "PDCORE_TP_TIMEOUT"


def test_sglang_names_and_defaults_are_the_seed_pages() -> None:
    """SGLang's PD page documents these names with these defaults; ours read the same."""
    seeds = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": 300,
             "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": 300,
             "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": 5.0,
             "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": 2,
             "SGLANG_DISAGGREGATION_QUEUE_SIZE": 4,
             "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL": 120,
             "SGLANG_DISAGG_STAGING_BUFFER": False,
             "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": 64,
             "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": 4096}
    for name, default in seeds.items():
        assert env.by_name(name).read({}) == default, name
    assert env.by_name("SGLANG_DISAGGREGATION_NIXL_BACKEND").documented_default == "UCX"


@pytest.mark.parametrize("name, raw, says", [
    ("PDSERVE_HTTP_BODY_TIMEOUT_S", "soon", "PDSERVE_HTTP_BODY_TIMEOUT_S='soon': give a number > 0"),
    ("PDCORE_MAX_REQUEST_BYTES", "12", "PDCORE_MAX_REQUEST_BYTES='12': give a byte count >= 1024"),
    ("PDCORE_TP_TIMEOUT", "ten", "PDCORE_TP_TIMEOUT must be a number, got 'ten'"),
    ("PDCORE_GEMM_LAYOUT", "fastest", "PDCORE_GEMM_LAYOUT must be one of auto, panels, onednn"),
    ("PDCORE_HOST_SERVERS", "0", "PDCORE_HOST_SERVERS must be a whole number >= 1"),
])
def test_a_bad_value_is_an_error_naming_the_variable(name, raw, says) -> None:
    with pytest.raises(EnvError, match=says.replace("(", r"\(")) as info:
        env.check({name: raw})
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    env.check({})  # the defaults themselves parse


def test_child_environ_and_put(monkeypatch) -> None:
    monkeypatch.setenv("PDCORE_KEEP_TEST_LOGS", "1")
    child = env.child_environ({"TMPDIR": "/x", "PDCORE_KEEP_TEST_LOGS": None})
    assert child["TMPDIR"] == "/x" and "PDCORE_KEEP_TEST_LOGS" not in child
    assert ENV.pdcore_keep_test_logs  # the child's copy, not ours
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    env.put({"GOMP_SPINCOUNT": None})
    assert not ENV.is_set("GOMP_SPINCOUNT")


@pytest.mark.parametrize("command", [
    ["-m", "pdcore.launch_server", "--model-path", "MODEL"],
    ["-m", "pdcore.router", "--pd-disaggregation", "--prefill", "http://127.0.0.1:1",
     "--decode", "http://127.0.0.1:2"],
    ["-m", "pdcore", "up", "--model-path", "MODEL"],
])
def test_entry_points_exit_2_naming_a_bad_variable(command, tiny_llama_dir) -> None:
    """At start-up, not as a traceback deep in the first request (the router read its limits
    only when a request came)."""
    command = [str(tiny_llama_dir) if c == "MODEL" else c for c in command]
    run = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "PDSERVE_HTTP_SEND_TIMEOUT_S": "-1"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "PDSERVE_HTTP_SEND_TIMEOUT_S='-1': give a number > 0" in run.stderr
    assert "Traceback" not in run.stderr
