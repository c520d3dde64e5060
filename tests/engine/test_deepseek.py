"""DeepSeek-V2/V3 (MLA + MoE): greedy output equals transformers, unified, with TP=2 and with
EP=2; the KV pool holds one latent row per token and layer."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model

ARCHS = ["deepseek_v2", "deepseek_v3"]
LATENT = 32 + 8  # the tiny configs' kv_lora_rank + qk_rope_head_dim


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(arch, path, prompts, transformers references); 3 layers: one dense, two MoE."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    path = make_tiny_model(str(tmp_path_factory.mktemp(arch) / "m"), arch=arch, layers=3, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 37, 150, 61, 9)]
    return arch, path, prompts, [hf_greedy(hf, p, 20) for p in prompts]


def _generate(path: str, prompts: list[list[int]], **kw) -> tuple[list[dict], dict]:
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048, chunked_prefill_size=64,
                               **kw))
    try:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.0),
                            return_logprob=True)
        assert pages_at_rest(eng.scheduler)
        layout = eng.engine.kv.layout()  # rank 0's
    finally:
        eng.close()
    return outs, {"layout": layout}


def _check(outs: list[dict], refs) -> list[str]:
    return [check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])
            for o, r in zip(outs, refs)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_unified_matches_transformers(tiny, page_size):
    """Mixed prefill/decode batches, the 150-token prompt in 3 chunks of 64."""
    _, path, prompts, refs = tiny
    outs, seen = _generate(path, prompts, page_size=page_size)
    verdicts = _check(outs, refs)
    assert verdicts.count("identical") >= len(prompts) - 1, verdicts
    lay = seen["layout"]
    assert lay.is_mla and lay.kv_heads == 1 and lay.head_dim == LATENT
    assert lay.v_bases == lay.k_bases  # the latent is K and V: no second buffer
    assert lay.item_len == page_size * LATENT * 4


@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_matches_transformers(tiny, ep):
    """Query heads split 2 + 2, latent replicated; experts sharded by intermediate features
    (ep 1) or 4 whole experts per rank with all-to-all dispatch (ep 2)."""
    _, path, prompts, refs = tiny
    outs, _ = _generate(path, prompts, page_size=4, tp_size=2, ep_size=ep)
    verdicts = _check(outs, refs)
    assert verdicts.count("identical") >= len(prompts) - 1, verdicts


def test_pool_holds_one_latent_per_token_and_layer(tmp_path):
    """The pool's bytes per token are the latent's, a fraction of per-head K/V (4 heads x
    (16 + 8) K + 4 x 16 V = 160 floats per layer, against 40)."""
    path = make_tiny_model(str(tmp_path / "m"), arch="deepseek_v3", layers=2, seed=1)
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=256, page_size=4))
    try:
        info, kv = eng.engine.info, eng.engine.kv
        assert info.is_mla and info.kv_bytes_per_token == 2 * LATENT * 4
        assert len(kv.regions()) == 2  # one buffer per layer
        assert all(k.data_ptr() == v.data_ptr() for k, v in kv.layers)
        assert kv.layers[0][0].shape == (64, 4, 1, LATENT)
    finally:
        eng.close()
    # #48: an FP8 KV pool serves the Llama-family attention; MLA's latent is refused, named
    from pdcore.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8_e4m3.*MLA"):
        LLMEngine(ServerArgs(model_path=path, max_total_tokens=256, kv_cache_dtype="fp8_e4m3"))


def test_prefix_cache_hits_reuse_latent_pages(tiny):
    """Requests sharing a cached prefix attend over latent pages written by an earlier request
    (the radix cache is on by default): same tokens as transformers, and the cache was hit."""
    from transformers import AutoModelForCausalLM

    _, path, prompts, _ = tiny
    base = prompts[2][:80]
    later = [base + prompts[1][:20], base[:48] + prompts[4]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, 12) for p in later]
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048, page_size=4,
                               chunked_prefill_size=64))
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)
    try:
        eng.generate([base], sp)
        outs = eng.generate(later, sp, return_logprob=True)
        hits = eng.loop.stats()["cache_hit_tokens_total"]
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert hits >= 80 - 4 + 48, hits  # whole pages of each shared prefix
    verdicts = _check(outs, refs)
    assert verdicts.count("identical") >= 1, verdicts
