"""Rotary position embedding tables for the Llama family, with transformers' own inverse
frequencies (its `modeling_rope_utils`, which the config module imports anyway) but without
importing a transformers model module: `modeling_llama` alone adds ~70 MiB to the engine's
resident memory. cos/sin are computed as transformers' LlamaRotaryEmbedding computes them.

Rope types whose frequencies change with the sequence length (`dynamic`, `longrope`) keep
transformers' module, which carries that update.
"""

from __future__ import annotations

import torch
from torch import nn

_DYNAMIC = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        params = cfg.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.attention_scaling = scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., positions, dim] in x's dtype for position_ids [..., positions]."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device,
                                                                   dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def make_rotary(cfg) -> nn.Module:
    if cfg.rope_parameters.get("rope_type", "default") in _DYNAMIC:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding(cfg)
    return RotaryEmbedding(cfg)
