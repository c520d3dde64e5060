"""MoE families (Qwen2-MoE, Qwen3-MoE, Mixtral) in the unified engine: greedy output equals
transformers `generate` on tiny random models, in a mixed, chunked batch."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.errors import ConfigError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model

MOE_ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral"]


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_model_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(str(tmp_path / arch), arch=arch, vocab_size=512, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(512, [5, 37, 130, 9])
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    # chunk 48: the 130-token prompt takes 3 chunks next to decoding sequences
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048, page_size=4,
                               chunked_prefill_size=48))
    try:
        assert eng.loop.runner.model.__class__.__name__ != "LlamaForCausalLM"
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.0),
                            return_logprob=True)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    verdicts = [check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])
                for o, r in zip(outs, refs)]
    assert verdicts.count("identical") >= 3, verdicts


def test_mixtral_sliding_window_refused(tmp_path):
    import json

    path = make_tiny_model(str(tmp_path / "mx"), arch="mixtral", vocab_size=128, layers=1)
    cfg_file = tmp_path / "mx" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["sliding_window"] = 64
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="sliding_window"):
        LLMEngine(ServerArgs(model_path=path, max_total_tokens=256))
