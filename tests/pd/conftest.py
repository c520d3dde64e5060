"""PD end-to-end fixtures: unified-engine references for the shared prompt set."""

from __future__ import annotations

import pytest

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.tokenizer import load_tokenizer
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.prompts import prompt_token_ids

NEW_TOKENS = 48


@pytest.fixture(scope="session")
def smollm2_unified():
    """(prompt ids, unified greedy outputs with logprobs) on SmolLM2, computed in-process."""
    tok = load_tokenizer(ServerArgs())
    prompts = prompt_token_ids(tok)
    eng = LLMEngine(ServerArgs(max_total_tokens=16384, page_size=16))
    try:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0),
                            return_logprob=True, logprob_start_len=0)
    finally:
        eng.close()
    return tok, prompts, outs
