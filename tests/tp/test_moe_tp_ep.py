"""MoE models over two ranks: TP experts (every rank a shard of every expert) and EP=2 (each
rank whole experts, tokens exchanged all-to-all over gloo) give transformers' greedy output."""

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

SP = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 47, 90, 1)]


def _run(path: str, prompts: list[list[int]], **kw) -> list[dict]:
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048, page_size=4,
                               chunked_prefill_size=64, **kw))
    try:
        moe = eng.loop.runner.model.layers[0].mlp  # rank 0's first MoE block
        ep = kw.get("ep_size", 1) > 1
        assert (moe.ep, moe.local_experts, moe.w13.shape[0]) == ((True, 4, 4) if ep
                                                                  else (False, 8, 8))
        outs = eng.generate(prompts, SP, return_logprob=True)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert all(not p.is_alive() for p in eng.ranks.children), "a rank outlived close()"
    return outs


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_moe_tp2_and_ep2_match_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    # 8 experts: EP puts 4 whole ones on each rank, TP half of every one on each
    path = make_tiny_model(str(tmp_path / arch), arch=arch, vocab_size=512, seed=9)
    prompts = _prompts(512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, SP.max_new_tokens) for p in prompts]
    for kw in ({"tp_size": 2}, {"tp_size": 2, "ep_size": 2}):
        outs = _run(path, prompts, **kw)
        verdicts = [check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])
                    for o, r in zip(outs, refs)]
        assert verdicts.count("identical") >= 3, (kw, verdicts)


def test_ep_size_must_span_the_tp_group():
    with pytest.raises(ConfigError, match="--ep-size 2 must be 1 or equal to --tp-size 4"):
        ServerArgs(tp_size=4, ep_size=2).validate()
    with pytest.raises(ConfigError, match="only 0"):
        ServerArgs(ep_num_redundant_experts=4).validate()
