"""Prompt logprobs against transformers; sampler knobs behave."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), vocab_size=512, seed=11)
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=4096, page_size=8,
                               chunked_prefill_size=32))
    yield path, eng
    eng.close()


def test_prompt_logprobs_match_transformers(tiny):
    from transformers import AutoModelForCausalLM

    path, eng = tiny
    prompt = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for start in (0, 1, 57):
        out = eng.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0),
                           return_logprob=True, logprob_start_len=start, top_logprobs_num=3)[0]
        entries = out["input_logprobs"]
        assert len(entries) == len(prompt) - start  # 100 prompt positions, 3 chunks of 32+
        for k, (val, tok, top) in enumerate(entries):
            p = start + k
            assert tok == prompt[p]
            if p == 0:
                assert val is None
                continue
            assert abs(val - float(lp[p - 1, tok])) < 1e-4
            want = torch.topk(lp[p - 1], 3)
            assert [t for _, t in top] == want.indices.tolist()


def test_seeded_sampling_is_reproducible_and_knobs_apply(tiny):
    _, eng = tiny
    prompt = [[5, 6, 7, 8, 9]]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    a = eng.generate(prompt, sp)[0]["output_ids"]
    b = eng.generate(prompt, sp)[0]["output_ids"]
    assert a == b
    greedy = eng.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                 ignore_eos=True))[0]["output_ids"]
    top1 = eng.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.9, top_k=1,
                                               ignore_eos=True))[0]["output_ids"]
    assert top1 == greedy
    tiny_p = eng.generate(prompt, SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1e-6,
                                                 seed=1, ignore_eos=True))[0]["output_ids"]
    assert tiny_p == greedy  # top_p that small keeps only the argmax
    rep = eng.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.0,
                                              frequency_penalty=100.0, ignore_eos=True))[0]
    assert len(set(rep["output_ids"])) == 16  # a huge frequency penalty forbids repeats


def test_stop_token_ids_and_max_new_tokens(tiny):
    _, eng = tiny
    prompt = [[5, 6, 7, 8, 9]]
    base = eng.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.0,
                                               ignore_eos=True))[0]
    assert len(base["output_ids"]) == 10 and base["finish_reason"]["type"] == "length"
    stop_at = base["output_ids"][3]
    first = base["output_ids"].index(stop_at)
    out = eng.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.0,
                                              stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out["output_ids"] == base["output_ids"][: first + 1]
    assert out["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_prompt_longer_than_context_is_rejected(tiny):
    _, eng = tiny
    out = eng.generate([[3] * 5000], SamplingParams(max_new_tokens=2))[0]
    assert out["error"] and "context length" in out["error"]
    assert pages_at_rest(eng.scheduler)
