"""Greedy output of our engine equals transformers `generate`, token for token."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model


def test_smollm2_gguf_matches_transformers(smollm2_greedy_refs, monkeypatch):
    """The 8 prompts, 24 tokens each (tests/conftest.py: transformers' references, shared with
    test_tp_engine; their generate is this test's cost). The GGUF de-quantized at load
    (PDCORE_GGUF_PACKED=0, pinned: transformers' own numerics; served packed, its integer dot is
    llama.cpp's, test_gguf_packed)."""
    from pdcore.engine.model.layers import weight_layouts

    monkeypatch.setenv("PDCORE_GGUF_PACKED", "0")
    prompts, refs, new = smollm2_greedy_refs
    eng = LLMEngine(ServerArgs(max_total_tokens=16384, page_size=16, chunked_prefill_size=256))
    try:
        assert weight_layouts(eng.loop.runner.model)["gguf"] == 0
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0),
                            return_logprob=True)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    verdicts = [
        check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])
        for o, r in zip(outs, refs)
    ]
    assert verdicts.count("identical") >= 7, verdicts


def _tiny_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_random_models_mixed_batch_chunked(tmp_path, arch, page_size):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(str(tmp_path / arch), arch=arch, vocab_size=512, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _tiny_prompts(512, [5, 37, 130, 290, 64, 9])
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    # chunk 96: the 290-token prompt spans 4 chunks, the 130-token one 2+
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=4096, page_size=page_size,
                               chunked_prefill_size=96))
    try:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0),
                            return_logprob=True)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    for o, r in zip(outs, refs):
        check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])


def test_alone_equals_inside_16_concurrent(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), arch="llama", vocab_size=512, seed=3)
    prompts = _tiny_prompts(512, [11 + 13 * i for i in range(16)], seed=5)
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=8192, page_size=4,
                               chunked_prefill_size=128))
    try:
        sp = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
        alone = eng.generate([prompts[5]], sp)[0]["output_ids"]
        together = eng.generate(prompts, sp)
    finally:
        eng.close()
    assert together[5]["output_ids"] == alone


def test_preemption_recomputes_identically(tmp_path):
    """A pool too small for every request at once forces preemption; outputs do not change."""
    path = make_tiny_model(str(tmp_path / "m"), arch="llama", vocab_size=512, seed=4)
    prompts = _tiny_prompts(512, [40] * 6, seed=9)
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    big = LLMEngine(ServerArgs(model_path=path, max_total_tokens=4096, page_size=4))
    try:
        want = [o["output_ids"] for o in big.generate(prompts, sp)]
    finally:
        big.close()
    small = LLMEngine(ServerArgs(model_path=path, max_total_tokens=200, page_size=4))
    try:
        got = [o["output_ids"] for o in small.generate(prompts, sp)]
        assert small.scheduler.counters.preempted > 0
        assert pages_at_rest(small.scheduler)
    finally:
        small.close()
    assert got == want


def test_long_context_chunked_and_paged_match_transformers(tmp_path, monkeypatch):
    """A 3,000-token prompt prefilled in 512-token chunks (each chunk after the first: the
    prefix without a mask and the chunk causally, merged), then decoded with the pool read in
    place (no decode K/V view: PDCORE_DECODE_KV_VIEW_MB=0): alone (a lone decode) and beside
    two shorter requests (a padded decode group, the native paged kernel); head_dim 64 so the
    native kernels apply. Greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM

    from pdcore.env import Env

    monkeypatch.setenv(Env.pdcore_decode_kv_view_mb.name, "0")
    path = make_tiny_model(str(tmp_path / "m"), arch="llama", vocab_size=512, seed=11,
                           hidden=128, heads=2, kv_heads=1, max_positions=4096)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _tiny_prompts(512, [3000, 700, 40], seed=13)
    refs = [hf_greedy(hf, p, 8) for p in prompts]
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=8192, chunked_prefill_size=512))
    try:
        sp = SamplingParams(max_new_tokens=8, temperature=0.0)
        alone = eng.generate(prompts[:1], sp, return_logprob=True)
        together = eng.generate(prompts, sp, return_logprob=True)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    for o, r in zip(alone + together, refs[:1] + refs):
        check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])
