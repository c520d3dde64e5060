"""A Llama-family config.json read without transformers.

transformers' model-specific config classes import its model-loading machinery (sympy,
torch.distributed.tensor, ...): ~95 MiB resident in every engine process, for a dozen numbers.
For the families whose forward pass is ours and plain (Llama, Mistral, Qwen2/3, Qwen2/3-MoE,
Mixtral) the engine reads config.json itself: the file's values over transformers' class
defaults for every field our model code reads (DEFAULTS; a test checks it against transformers'
classes), with transformers' few derived values (KV heads, sliding window, rope parameters).
Anything else (DeepSeek, remote code, GGUF read directly, `--load-format dummy`, which needs a
transformers config to build its random model) goes through AutoConfig.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

_BASE: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": None,
    "eos_token_id": None, "bos_token_id": None, "rope_theta": 10000.0,
}
_LLAMA_IDS = {"vocab_size": 32000, "eos_token_id": 2, "bos_token_id": 1}
_QWEN = {"use_sliding_window": False, "sliding_window": 4096}
_QWEN_MOE = {**_QWEN, "decoder_sparse_step": 1, "norm_topk_prob": False, "mlp_only_layers": []}
_NO_BIAS = {"attention_bias": False}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_BASE, **_LLAMA_IDS, **_NO_BIAS, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "mistral": {**_BASE, **_LLAMA_IDS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {**_BASE, **_QWEN},
    "qwen3": {**_BASE, **_QWEN, **_NO_BIAS, "head_dim": 128},
    "qwen2_moe": {**_BASE, **_QWEN_MOE, "hidden_size": 2048, "intermediate_size": 5632,
                  "num_hidden_layers": 24, "num_attention_heads": 16, "num_experts": 60,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "qkv_bias": True},
    "qwen3_moe": {**_BASE, **_QWEN_MOE, **_NO_BIAS, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_key_value_heads": 4, "num_local_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "mixtral": {**_BASE, **_LLAMA_IDS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2},
}
# transformers' attribute_map: `num_experts` names `num_local_experts` in these families
_EXPERT_ALIAS = ("mixtral", "qwen3_moe")
# families transformers does not ship (their checkpoints name remote code in `auto_map`) whose
# forward pass is ours: read over the defaults of the family they are built on
_NATIVE_REMOTE = {"mimo": "qwen2"}  # Xiaomi MiMo: a Qwen2 body + MTP layers (mimo.py)


def read_plain_config(folder: str, archs: tuple[str, ...]) -> SimpleNamespace | None:
    """The config of `folder` when it is a plain family of `archs`; None: use AutoConfig."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None  # AutoConfig says what is wrong with it
    model_type = raw.get("model_type")
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    base = _NATIVE_REMOTE.get(model_type, model_type)
    if base not in DEFAULTS or arch not in archs or ("auto_map" in raw and base == model_type):
        return None
    d = {**DEFAULTS[base], **raw, "architectures": [arch]}
    if d["num_key_value_heads"] is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    if "use_sliding_window" in d and not d["use_sliding_window"]:  # Qwen: the window is off
        d["sliding_window"] = 0 if model_type == "qwen2_moe" else None
    if model_type in _EXPERT_ALIAS:
        d["num_local_experts"] = d["num_experts"] = raw.get("num_experts",
                                                            d["num_local_experts"])
    d["rope_parameters"] = _rope_parameters(raw, d["rope_theta"])
    return SimpleNamespace(**d)


def _rope_parameters(raw: dict[str, Any], theta: float) -> dict[str, Any]:
    """transformers' standard form: `rope_parameters` (or the older `rope_scaling`, whose `type`
    became `rope_type`), with `rope_theta` (and `partial_rotary_factor`) moved in."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "type" in rope:  # transformers keeps the old key beside the new one
        rope.setdefault("rope_type", rope["type"])
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", theta)
    if raw.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    return rope
