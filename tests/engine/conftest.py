from __future__ import annotations

import pytest
import torch

from pdcore.engine.model.tokenizer import resolve_model


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' SmolLM2 (the reference), loaded once per session."""
    from transformers import AutoModelForCausalLM

    r = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.float32, **r.hf_kwargs()).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from pdcore.config import ServerArgs
    from pdcore.engine.model.tokenizer import load_tokenizer

    return load_tokenizer(ServerArgs())
