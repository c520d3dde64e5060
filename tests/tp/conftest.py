"""Fixtures for tensor-parallel tests: tiny models (random weights) saved once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdcore.testing.tiny_models import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tp_helpers
from tp_helpers import NEW


@pytest.fixture(scope="session")
def tiny_tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with the SmolLM2 tokenizer, 6 heads / 3 KV heads (uneven on 2 ranks), 2 layers:
    for server and PD tests that send text."""
    from pdcore.engine.model.tokenizer import default_model_file

    path = tmp_path_factory.mktemp("tp") / "llama6x3"
    return Path(make_tiny_model(str(path), hidden=96, layers=2, heads=6, kv_heads=3, seed=11,
                                tokenizer_from=default_model_file(), max_positions=8192))


@pytest.fixture(scope="session")
def prompts_and_unified(tiny_tp_model: Path):
    """(the shared prompt set as token ids, unified TP=1 greedy outputs) on tiny_tp_model."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.engine.model.tokenizer import load_tokenizer
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.prompts import prompt_token_ids

    prompts = prompt_token_ids(load_tokenizer(ServerArgs(model_path=str(tiny_tp_model))))
    eng = LLMEngine(ServerArgs(model_path=str(tiny_tp_model), max_total_tokens=16384,
                               page_size=4))
    try:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0))
    finally:
        eng.close()
    return prompts, [o["output_ids"] for o in outs]
