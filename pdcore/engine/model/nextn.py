"""NEXTN draft head (`--speculative-algorithm NEXTN`): a DeepSeek-V3 checkpoint's own multi-token
prediction (MTP) layer, SGLang's NEXTN.

The MTP layer sits after the model's layers, at index L = num_hidden_layers of the SAME
checkpoint (config num_nextn_predict_layers >= 1; an exported NextN checkpoint keeps it at
index 0), as `model.layers.{L}.*`:
- `enorm`, `hnorm` (RMSNorms) and `eh_proj` ([hidden, 2 * hidden], no bias): the layer's input
  is eh_proj(concat(enorm(embedding(t_{p+1})), hnorm(h_p))), the embedding half FIRST (as
  SGLang's deepseek_nextn.py and vLLM's deepseek_mtp.py concatenate it);
- one whole DeepSeek decoder layer (MLA attention, MoE or dense MLP, both norms), the target
  family's classes (engine/model/deepseek.py);
- `shared_head.norm` and, optionally, `shared_head.head` / `embed_tokens` (the target's lm_head
  and embedding serve where absent or equal).

h_p, the hidden state fed in at position p, is the target's FINAL-NORM output there: what its
lm_head reads and what the runner captures for EAGLE too (SGLang's DeepseekV3ForCausalLMNextN
reads spec_info.hidden_states, which its DeepSeek target captures after the final norm: the
DeepSeek model hands no pre-norm state to the logits processor; vLLM's DeepSeek-MTP likewise
takes the target model's output, which ends with the final norm). The head's output is
shared_head.norm of its layer's residual stream: its head scores the next token from it, and
it is the hidden state fed with that token at the next chain step (SGLang's chain). Its K/V are
the layer's latent rows, in a one-layer pool shaped like the target's (engine/sched/eagle.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcore.engine.model.base import CausalLM
from pdcore.engine.model.batch import ForwardBatch
from pdcore.engine.model.deepseek import DecoderLayer, LatentRotary, load_layer
from pdcore.engine.model.eagle import TargetShared
from pdcore.engine.model.layers import RMSNorm
from pdcore.engine.model.mtp import FLAG, mtp_layer_index, mtp_prefix
from pdcore.engine.model.modelslim import as_float
from pdcore.errors import ConfigError


class NextNHead(TargetShared, nn.Module):
    name = "NEXTN"

    def __init__(self, cfg: Any, target: CausalLM, index: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # TP: sharded as the target's layers (query heads, MoE experts; the latent is whole)
        self.layer = DecoderLayer(cfg, target.tp, index, target.arch)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)  # shared_head.norm
        self._target = (target,)  # embedding, lm_head, rotary; a tuple: not a submodule
        self.embed: nn.Embedding | None = None  # the layer's own, where it differs
        self.own_head: nn.Parameter | None = None  # shared_head.head, where it differs
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(heads, head_dim, latent) of the one-layer pool: one latent row per token (MLA)."""
        lat = self.layer.self_attn.latent_dim
        return 1, lat, True

    @property
    def rotary(self) -> LatentRotary:
        return self._target[0].rotary


    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """The head's outputs [T, hidden] for the pairs (hidden[i], batch.input_ids[i]) at
        batch.positions; their latent rows go into k_cache (v_cache is the same tensor) at
        batch.out_slots."""
        e = self.embed_tokens(batch.input_ids).to(hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        cos, sin = self.rotary(batch.positions)
        layer = self.layer
        residual = x + layer.self_attn(layer.input_layernorm(x), cos, sin, self.rotary,
                                       k_cache, batch)
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.norm(residual)

    @torch.inference_mode()
    def load(self, sd, p: str) -> None:
        """The MTP layer's weights, `p` its prefix (model.layers.{L}.)."""
        def get(name: str) -> torch.Tensor:
            if name not in sd:
                raise ConfigError(f"{FLAG}: the checkpoint's MTP layer lacks the weight {name}")
            return sd[name]

        self.enorm.weight.copy_(get(p + "enorm.weight"))
        self.hnorm.weight.copy_(get(p + "hnorm.weight"))
        self.eh_proj.weight.copy_(as_float(get(p + "eh_proj.weight")))  # int8: de-quantized
        self.norm.weight.copy_(get(p + "shared_head.norm.weight"))
        load_layer(self.layer, sd, p)
        # DeepSeek-V3 checkpoints repeat the embedding and lm_head in the MTP layer: kept only
        # where they differ from the target's (one copy of each otherwise)
        embed, lm = sd.get("model.embed_tokens.weight"), sd.get("lm_head.weight")
        lm = embed if lm is None else lm
        own = sd.get(p + "embed_tokens.weight")
        if own is not None and (embed is None or not torch.equal(own, embed)):
            self.embed = nn.Embedding(*own.shape)
            self.embed.weight.requires_grad_(False)
            self.embed.weight.copy_(own)
        own = sd.get(p + "shared_head.head.weight")
        if own is not None and (lm is None or not torch.equal(own, lm)):
            self.own_head = nn.Parameter(own.clone(), requires_grad=False)


def load_nextn_head(target: CausalLM, folder: str, dtype: torch.dtype,
                    device: torch.device) -> NextNHead:
    """The MTP layer of the checkpoint at `folder` (the target's own unless
    --speculative-draft-model-path names another) beside `target`."""
    from pdcore.engine.model.fp8 import quantized_weights
    from pdcore.engine.model.weights import SafetensorsWeights

    index = mtp_layer_index(target.cfg)
    sd = SafetensorsWeights(folder)
    prefix = mtp_prefix(sd, index, folder)
    head = NextNHead(target.cfg, target, index)
    head.load(quantized_weights(sd, folder), prefix)
    with torch.inference_mode():
        head = head.to(device=device, dtype=dtype).eval()
    sd.release_pages()
    return head
