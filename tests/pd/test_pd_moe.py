"""PD with MoE models (real servers on loopback, tcp): Qwen2-MoE prefilled by TP2 + EP2 and
decoded by TP1, Qwen3-MoE prefilled by TP1 and decoded by TP2 experts, Mixtral TP1 -> TP1.
Greedy output equals transformers and both servers end with every page free."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))  # tp_helpers
from tp_helpers import FAST_ENV, FLAGS, Fleet, pd_generate

from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import ServerProcess, free_port
from pdcore.testing.tiny_models import make_tiny_model

NEW = 12
CASES = {
    "qwen2_moe": (["--tp-size", "2", "--ep-size", "2"], ["--tp-size", "1"]),
    "qwen3_moe": (["--tp-size", "1"], ["--tp-size", "2"]),
    "mixtral": (["--tp-size", "1"], ["--tp-size", "1"]),
}


def _fleet(model: str, p_flags: list[str], d_flags: list[str]) -> Fleet:
    """A Fleet (tp_helpers) whose servers carry extra flags (--ep-size)."""
    fleet = Fleet("tcp", model, {})
    fleet.boot["p"] = free_port()
    common = [*FLAGS, "--model-path", model, "--disaggregation-transfer-backend", "tcp"]
    fleet.servers["p"] = ServerProcess(
        *common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
        str(fleet.boot["p"]), *p_flags, env=dict(FAST_ENV))
    fleet.servers["d"] = ServerProcess(*common, "--disaggregation-mode", "decode", *d_flags,
                                       env=dict(FAST_ENV))
    return fleet.start()


@pytest.mark.parametrize("arch", list(CASES))
def test_pd_moe_tcp_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from pdcore.engine.tokenizer import default_model_file

    path = make_tiny_model(str(tmp_path / arch), arch=arch, seed=13,
                           tokenizer_from=default_model_file(), max_positions=8192)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 45, 130)]
    refs = [hf_greedy(hf, p, NEW) for p in prompts]
    fleet = _fleet(path, *CASES[arch])
    try:
        verdicts = []
        for i, (ids, ref) in enumerate(zip(prompts, refs)):
            status, out = pd_generate(fleet, "p", "d", ids, NEW)
            assert status == 200, f"{arch} prompt {i}: {out}"
            verdicts.append(check_greedy(out["output_ids"], ref))
        assert verdicts.count("identical") >= 2, verdicts
        for name in ("p", "d"):
            load = fleet.load(name)
            assert load_at_rest(load), (name, load)
    finally:
        fleet.stop()
