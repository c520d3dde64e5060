"""Mixtral: Mistral attention (llama.py) with a sparse MoE block in every layer, softmax top-k
routing renormalised over the chosen experts, no shared expert."""

from __future__ import annotations

import torch
from torch import nn

from pdcore.engine.model.llama import LlamaForCausalLM
from pdcore.engine.model.moe import MoE, RouterSpec
from pdcore.errors import ConfigError

SUPPORTED_ARCHS = {"MixtralForCausalLM": "mixtral"}


class MixtralForCausalLM(LlamaForCausalLM):
    ARCHS = SUPPORTED_ARCHS

    def __init__(self, cfg, tp=None) -> None:
        if getattr(cfg, "sliding_window", None):
            # our attention has no window: refusing beats silently attending to everything
            raise ConfigError(f"Mixtral with sliding_window={cfg.sliding_window} is not "
                              "supported (the engine's attention has no sliding window)")
        super().__init__(cfg, tp)

    def _make_mlp(self, cfg, layer: int) -> nn.Module | None:
        return MoE(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size,
                   RouterSpec(top_k=cfg.num_experts_per_tok, renormalize=True), self.tp,
                   ep_size=self.tp.ep_size, act=cfg.hidden_act)

    def _load_mlp(self, mlp: nn.Module, sd: dict[str, torch.Tensor], prefix: str) -> None:
        mlp.load_hf(sd, prefix)
