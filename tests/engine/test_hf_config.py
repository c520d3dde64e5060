"""The engine's own config.json reader (hf_config.py) gives every field our model code reads the
value transformers' AutoConfig gives it: class defaults, derived values and rope parameters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from pdcore.engine.model.hf_config import DEFAULTS, read_plain_config
from pdcore.engine.model.loader import MODEL_CLASSES

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
          "rms_norm_eps", "tie_word_embeddings", "attention_bias", "qkv_bias", "sliding_window",
          "eos_token_id", "rope_parameters", "num_experts", "num_experts_per_tok",
          "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
          "decoder_sparse_step", "mlp_only_layers", "num_local_experts", "architectures")
ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "mixtral": "MixtralForCausalLM"}
PLAIN = tuple(a for a in MODEL_CLASSES if not a.startswith("Deepseek"))
MISSING = object()
VARIANTS = [
    {},  # every default
    {"num_key_value_heads": 2, "num_attention_heads": 8, "hidden_size": 256, "head_dim": 32,
     "rope_theta": 500000.0, "tie_word_embeddings": True, "eos_token_id": [5, 7],
     "num_experts": 4},
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
     "max_position_embeddings": 8192},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                         "original_max_position_embeddings": 1024}, "sliding_window": 128,
     "use_sliding_window": True},
]


def _effective(cfg, field: str):
    """The value our model code sees: it reads optional fields with getattr(cfg, f, None),
    except `qkv_bias`, whose absence means the family's own default."""
    value = getattr(cfg, field, MISSING)
    return None if value is MISSING and field != "qkv_bias" else value


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_reader_agrees_with_autoconfig(tmp_path, model_type: str, variant: int) -> None:
    raw = {"model_type": model_type, "architectures": [ARCHS[model_type]], **VARIANTS[variant]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, ref = read_plain_config(str(tmp_path), PLAIN), AutoConfig.from_pretrained(tmp_path)
    assert ours is not None
    wrong = {f: (_effective(ours, f), _effective(ref, f)) for f in FIELDS
             if _effective(ours, f) != _effective(ref, f)}
    assert not wrong, wrong
    assert _head_dim(ours) == _head_dim(ref)


def test_other_configs_go_to_autoconfig(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}))
    assert read_plain_config(str(tmp_path), PLAIN) is None
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}))
    assert read_plain_config(str(tmp_path), PLAIN) is None


def test_engine_loads_smollm2_without_transformers_models() -> None:
    """The engine's load of the default model imports no transformers config or model class."""
    code = ("import sys, torch; from pdcore.engine.model.loader import load_model; "
            "load_model(None, torch.float32, torch.device('cpu')); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, check=True)
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:]
