"""MiMo (Xiaomi, architecture "MiMoForCausalLM", model_type "mimo"): a Qwen2 body whose checkpoint
also holds N multi-token prediction (MTP) layers (config num_nextn_predict_layers), which draft
for `--speculative-algorithm NEXTN` (the first layer) and, with `--enable-multi-layer-eagle`
(EAGLE or NEXTN), all N layers as one chain (engine/sched/mtp_chain.py).

The target is the Qwen2 forward pass (q/k/v biases) registered under MiMo's architecture; its
loader reads the body's weights by name, so the MTP weights are left where they are.

MTP layer i keeps its weights under `model.mtp_layers.{i}.` (checked against vLLM's and SGLang's
mimo_mtp.py, which map the same names):
- `token_layernorm`, `hidden_layernorm` (RMSNorms) and `input_proj` ([hidden, 2 * hidden], no
  bias): the layer's input is input_proj(concat(hidden_layernorm(h), token_layernorm(e))), the
  HIDDEN half first (the reverse of DeepSeek's NEXTN, engine/model/nextn.py), where e is the
  token's embedding, zeroed at position 0 (both sources mask the embedding of rows at
  position 0);
- a whole Qwen2 decoder layer under the same prefix (`input_layernorm`, `self_attn` q/k/v with
  biases and o_proj, `post_attention_layernorm`, `mlp`): residual stream x + attention, + MLP;
- `final_layernorm` of that residual stream: the layer's output. The target's lm_head scores
  the next token from it and the target's embedding embeds the tokens (MiMo's MTP layers share
  both; neither source loads a per-layer copy).

h, the hidden state fed to layer 0 at position p, is the target's FINAL-NORM output there (what
its lm_head reads: vLLM's Qwen2 model returns it after the norm, SGLang's EAGLE capture reads the
logits processor's input); layer j > 0 reads layer j - 1's output. Layer j at position p reads
the pair (layer j-1's output at p, token t_{p+1+j}) and scores t_{p+2+j}: the sequential MTP of
DeepSeek-V3's paper that MiMo trains, and what SGLang's multi-layer EAGLE draft-extend runs
(every step's layer over the same positions, the input ids shifted by one more token each
step). Each layer attends its own K/V (one pool per layer, engine/sched/mtp_chain.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcore.engine.model.base import CausalLM
from pdcore.engine.model.batch import ForwardBatch
from pdcore.engine.model.eagle import TargetShared
from pdcore.engine.model.layers import RMSNorm, TPInfo
from pdcore.engine.model.llama import DecoderLayer, LlamaForCausalLM
from pdcore.engine.model.mtp import MULTI_FLAG, mimo_mtp_layers, mimo_prefix
from pdcore.errors import ConfigError

SUPPORTED_ARCHS = {"MiMoForCausalLM": "qwen2"}


class MiMoForCausalLM(LlamaForCausalLM):
    """The target: Qwen2's layers and weights (its MTP layers are the draft head's)."""

    ARCHS = SUPPORTED_ARCHS


class MTPLayer(nn.Module):
    """One MTP layer; with TP its decoder layer is sharded as the target's (its K/V heads split
    alike, so each rank's pool has the target's per-rank geometry and, in PD mode, travels as
    one more layer of it); the norms and input_proj are whole on every rank."""

    def __init__(self, cfg: Any, tp: TPInfo) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(cfg, tp, "qwen2")
        self.final_layernorm = RMSNorm(h, eps)

    @torch.inference_mode()
    def load(self, sd, p: str) -> None:
        def get(name: str) -> torch.Tensor:
            if p + name not in sd:
                raise ConfigError(f"{MULTI_FLAG} / NEXTN: the MiMo checkpoint's MTP layer lacks "
                                  f"the weight {p + name}")
            return sd[p + name]

        self.token_layernorm.weight.copy_(get("token_layernorm.weight"))
        self.hidden_layernorm.weight.copy_(get("hidden_layernorm.weight"))
        self.input_proj.weight.copy_(get("input_proj.weight"))
        self.final_layernorm.weight.copy_(get("final_layernorm.weight"))
        b = self.block
        names = ("q_proj", "k_proj", "v_proj")
        b.self_attn.qkv.load([get(f"self_attn.{n}.weight") for n in names],
                             [get(f"self_attn.{n}.bias") for n in names])
        b.self_attn.o_proj.load(get("self_attn.o_proj.weight"))
        b.mlp.gate_up.load([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        b.mlp.down.load(get("mlp.down_proj.weight"))
        b.input_layernorm.weight.copy_(get("input_layernorm.weight"))
        b.post_attention_layernorm.weight.copy_(get("post_attention_layernorm.weight"))


class MiMoMTPHead(TargetShared, nn.Module):
    """N MTP layers as one draft head: `forward(..., layer=j)` runs layer j (DraftHead, with
    `num_layers` > 1 driven by engine/sched/mtp_chain.py; one layer: by HeadDrafter as is)."""

    name = "MTP"

    def __init__(self, cfg: Any, target: CausalLM, layers: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.mtp = nn.ModuleList(MTPLayer(cfg, target.tp) for _ in range(layers))
        self._target = (target,)  # embedding, lm_head, rotary; a tuple: not a submodule
        self.embed: nn.Embedding | None = None  # MiMo's MTP layers share the target's
        self.own_head: nn.Parameter | None = None
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def num_layers(self) -> int:
        return len(self.mtp)

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(heads, head_dim, latent) of each layer's pool: separate K and V, as the target's."""
        a = self.mtp[0].block.self_attn
        return a.num_kv_heads, a.head_dim, False

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Layer `layer`'s outputs [T, hidden] for the pairs (hidden[i], batch.input_ids[i]) at
        batch.positions; its K/V go into k_cache / v_cache at batch.out_slots."""
        m = self.mtp[layer]
        e = self.embed_tokens(batch.input_ids).to(hidden.dtype)
        e = e.masked_fill((batch.positions == 0).unsqueeze(-1), 0.0)
        x = m.input_proj(torch.cat([m.hidden_layernorm(hidden), m.token_layernorm(e)], dim=-1))
        cos, sin = self._target[0].rotary(x.unsqueeze(0), batch.positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1).to(x.dtype), sin[0].unsqueeze(1).to(x.dtype)
        b = m.block
        r = x + b.self_attn(b.input_layernorm(x), cos, sin, k_cache, v_cache, batch)
        r = r + b.mlp(b.post_attention_layernorm(r))
        return m.final_layernorm(r)


def load_mimo_head(target: CausalLM, folder: str, multi: bool, dtype: torch.dtype,
                   device: torch.device) -> MiMoMTPHead:
    """The MTP layers of the MiMo checkpoint at `folder` (the target's own unless
    --speculative-draft-model-path names another): all of them with `multi`
    (--enable-multi-layer-eagle), else the first."""
    from pdcore.engine.model.fp8 import quantized_weights
    from pdcore.engine.model.mtp import check_mimo_names
    from pdcore.engine.model.weights import SafetensorsWeights

    n = mimo_mtp_layers(target.cfg, multi)
    sd = quantized_weights(SafetensorsWeights(folder), folder)
    check_mimo_names(sd, n, folder, MULTI_FLAG if multi else "--speculative-algorithm NEXTN")
    head = MiMoMTPHead(target.cfg, target, n)
    for i, layer in enumerate(head.mtp):
        layer.load(sd, mimo_prefix(i))
    with torch.inference_mode():
        head = head.to(device=device, dtype=dtype).eval()
    sd.release_pages()
    return head
