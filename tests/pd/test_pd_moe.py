"""PD with MoE models (real servers on loopback), every family over every backend: Qwen2-MoE
prefilled by TP2 + EP2 and decoded by TP1, Qwen3-MoE prefilled by TP1 and decoded by TP2 experts,
Mixtral TP1 -> TP1, over tcp, mooncake and nixl (the last two slow, where installed); over shm
Qwen2-MoE TP1 -> TP1 (shm moves the KV pages, which an MoE model lays out as a dense one does:
one family shows MoE through shm; every family and layout runs over tcp, and shm's own paths
run in the backend contract, test_pd_mla and test_pd_faults). Greedy output equals transformers and both servers end with every page
free. Each family's tiny model and its transformers references are built once per module."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))  # tp_helpers
from tp_helpers import FAST_ENV, FLAGS, PLUGIN_BACKENDS, Fleet, pd_generate, plugin_backend_env

from pdcore.testing.greedy import Reference, check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import ServerProcess, free_port
from pdcore.testing.tiny_models import make_tiny_model

pytestmark = pytest.mark.heavy  # TP/EP process trees

NEW = 12
EP2 = ["--tp-size", "2", "--ep-size", "2"]
TP1, TP2 = ["--tp-size", "1"], ["--tp-size", "2"]
# each family's P and D layout (expert parallel, expert-sharding TP, plain), used on every
# backend but shm, where TP1 -> TP1 keeps the CI run short (shm's hetero TP runs with MLA)
LAYOUTS = {"qwen2_moe": (EP2, TP1), "qwen3_moe": (TP1, TP2), "mixtral": (TP1, TP1)}
SHM_LAYOUT = (TP1, TP1)

Model = tuple[str, list[list[int]], list[Reference]]  # path, prompts, transformers references


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Model]:
    """arch -> (path, prompts, references), each family built once for the whole module."""
    built: dict[str, Model] = {}

    def get(arch: str) -> Model:
        if arch not in built:
            from transformers import AutoModelForCausalLM

            from pdcore.engine.model.tokenizer import default_model_file

            path = make_tiny_model(str(tmp_path_factory.mktemp(arch) / "m"), arch=arch,
                                   seed=13, tokenizer_from=default_model_file(),
                                   max_positions=8192)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            g = torch.Generator().manual_seed(4)
            prompts = [torch.randint(100, 40000, (n,), generator=g).tolist()
                       for n in (7, 45, 130)]
            built[arch] = (path, prompts, [hf_greedy(hf, p, NEW) for p in prompts])
        return built[arch]

    return get


def _fleet(model: str, backend: str, p_flags: list[str], d_flags: list[str],
           env: dict[str, str] | None = None) -> Fleet:
    """A Fleet (tp_helpers) whose servers carry extra flags (--ep-size)."""
    fleet = Fleet(backend, model, {})
    fleet.boot["p"] = free_port()
    common = [*FLAGS, "--model-path", model, "--disaggregation-transfer-backend", backend]
    env = {**FAST_ENV, **(env or {})}
    fleet.servers["p"] = ServerProcess(
        *common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
        str(fleet.boot["p"]), *p_flags, env=env)
    # no router: D accepts routes to this P's bootstrap address because it is told to
    fleet.servers["d"] = ServerProcess(
        *common, "--disaggregation-mode", "decode", "--disaggregation-trusted-prefill",
        f"127.0.0.1:{fleet.boot['p']}", *d_flags, env=env)
    return fleet.start()


@pytest.mark.parametrize("arch", list(LAYOUTS))
def test_pd_moe_tcp(moe_model, arch):
    _run(moe_model(arch), arch, "tcp", *LAYOUTS[arch])


@pytest.mark.parametrize("arch", ["qwen2_moe"])
def test_pd_moe_shm(moe_model, arch):
    _run(moe_model(arch), arch, "shm", *SHM_LAYOUT)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(LAYOUTS))
@pytest.mark.parametrize("backend", list(PLUGIN_BACKENDS))
def test_pd_moe_plugin_backends(moe_model, backend, arch):
    env = plugin_backend_env(backend)
    _run(moe_model(arch), arch, backend, *LAYOUTS[arch], env)


def _run(model: Model, arch: str, backend: str, p_flags: list[str], d_flags: list[str],
         env: dict[str, str] | None = None) -> None:
    path, prompts, refs = model
    fleet = _fleet(path, backend, p_flags, d_flags, env)
    try:
        verdicts = []
        for i, (ids, ref) in enumerate(zip(prompts, refs)):
            status, out = pd_generate(fleet, "p", "d", ids, NEW)
            assert status == 200, f"{arch} over {backend} prompt {i}: {out}"
            verdicts.append(check_greedy(out["output_ids"], ref))
        assert verdicts.count("identical") >= 2, verdicts
        for name in ("p", "d"):
            load = fleet.load(name)
            assert load_at_rest(load), (name, load)
    finally:
        fleet.stop()
