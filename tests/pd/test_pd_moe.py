"""PD with MoE models (real servers on loopback): over tcp, Qwen2-MoE prefilled by TP2 + EP2 and
decoded by TP1, Qwen3-MoE prefilled by TP1 and decoded by TP2 experts, Mixtral TP1 -> TP1; Mixtral
over shm; Qwen2-MoE P TP2+EP2 -> D TP1 over mooncake and nixl (slow, where installed).
Greedy output equals transformers and both servers end with every page free."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))  # tp_helpers
from tp_helpers import FAST_ENV, FLAGS, PLUGIN_BACKENDS, Fleet, pd_generate, plugin_backend_env

from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import ServerProcess, free_port
from pdcore.testing.tiny_models import make_tiny_model

NEW = 12
EP2 = ["--tp-size", "2", "--ep-size", "2"]
TP1, TP2 = ["--tp-size", "1"], ["--tp-size", "2"]
CASES = {  # id: (arch, backend, P flags, D flags)
    "qwen2_moe-tcp-ep2-to-tp1": ("qwen2_moe", "tcp", EP2, TP1),
    "qwen3_moe-tcp-tp1-to-tp2": ("qwen3_moe", "tcp", TP1, TP2),
    "mixtral-tcp": ("mixtral", "tcp", TP1, TP1),
    "mixtral-shm": ("mixtral", "shm", TP1, TP1),
}


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
    fleet.servers["d"] = ServerProcess(*common, "--disaggregation-mode", "decode", *d_flags,
                                       env=env)
    return fleet.start()


@pytest.mark.parametrize("case", list(CASES))
def test_pd_moe_matches_transformers(tmp_path, case):
    _run(tmp_path, *CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(PLUGIN_BACKENDS))
def test_pd_moe_ep2_plugin_backends(tmp_path, backend):
    env = plugin_backend_env(backend)
    _run(tmp_path, "qwen2_moe", backend, EP2, TP1, env)


def _run(tmp_path: Path, arch: str, backend: str, p_flags: list[str], d_flags: list[str],
         env: dict[str, str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from pdcore.engine.tokenizer import default_model_file

    path = make_tiny_model(str(tmp_path / arch), arch=arch, seed=13,
                           tokenizer_from=default_model_file(), max_positions=8192)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 45, 130)]
    refs = [hf_greedy(hf, p, NEW) for p in prompts]
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
