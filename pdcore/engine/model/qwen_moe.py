"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 attention of llama.py with MoE feed-forward blocks.

Layer i is sparse unless it is listed in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; dense layers keep the plain MLP of `intermediate_size`. Qwen2-MoE adds a
shared expert whose output is scaled by sigmoid(shared_expert_gate(x)); Qwen3-MoE has none.
Routing: softmax over the experts, top-k, renormalised when `norm_topk_prob`.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcore.engine.model.llama import LlamaForCausalLM
from pdcore.engine.model.moe import MoE, RouterSpec

SUPPORTED_ARCHS = {"Qwen2MoeForCausalLM": "qwen2", "Qwen3MoeForCausalLM": "qwen3"}


def is_sparse_layer(cfg, layer: int) -> bool:
    return (layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0 and (layer + 1) % cfg.decoder_sparse_step == 0)


class QwenMoeForCausalLM(LlamaForCausalLM):
    ARCHS = SUPPORTED_ARCHS

    def _make_mlp(self, cfg, layer: int) -> nn.Module | None:
        if not is_sparse_layer(cfg, layer):
            return None
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        return MoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                   RouterSpec(top_k=cfg.num_experts_per_tok,
                              renormalize=bool(cfg.norm_topk_prob)),
                   self.tp, ep_size=self.tp.ep_size, shared_inter=shared,
                   shared_gate=shared > 0, act=cfg.hidden_act)

    def _load_mlp(self, mlp: nn.Module, sd: dict[str, torch.Tensor], prefix: str) -> None:
        if isinstance(mlp, MoE):
            mlp.load_hf(sd, prefix)
        else:
            super()._load_mlp(mlp, sd, prefix)
