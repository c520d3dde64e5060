"""Tiny random llama-family models built from transformers configs at test time."""

from __future__ import annotations

import os

import torch

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}


def make_tiny_model(path: str, arch: str = "llama", vocab_size: int = 512, seed: int = 0,
                    hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    max_positions: int = 4096, tokenizer_from: str | None = None,
                    tie: bool = False) -> str:
    """Save a random model (config.json + safetensors) to `path`; returns `path`.

    tokenizer_from: a resolved-model folder/gguf whose tokenizer is saved alongside (its
    vocabulary size then sets the model's).
    """
    import transformers

    cfg_name, model_name, extra = ARCH_CONFIGS[arch]
    tok = None
    if tokenizer_from is not None:
        from pdcore.engine.tokenizer import resolve_model

        r = resolve_model(tokenizer_from)
        tok = transformers.AutoTokenizer.from_pretrained(r.path, **r.hf_kwargs())
        vocab_size = len(tok)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(torch.float32).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path
