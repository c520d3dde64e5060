"""EAGLE-1 draft head (`--speculative-algorithm EAGLE`) for a Llama-family target.

The checkpoint (an HF folder: config.json with architectures ["LlamaForCausalLMEagle"],
safetensors) holds
- `fc` ([hidden, 2 * hidden], a bias where the checkpoint has one): projects
  concat(token embedding, target hidden state) to the layer's input;
- one Llama decoder layer `layers.0.*` without its input norm (EAGLE-1 drops it): attention
  and MLP as the target's family, post-attention norm;
- optionally its own `embed_tokens` / `lm_head`; otherwise the target's serve (shared, not
  copied). Names may carry a `model.` prefix.

The hidden state fed in is the one the target's lm_head reads (after its final norm) at the
position before the token; the head's output (residual stream after its one layer, no norm)
goes through the lm_head to score the next token, and is itself the hidden state fed with that
token to the next draft step. The head's K/V for its one layer live in a pool of the drafter's
(engine/sched/eagle.py), addressed by the same slots as the target's pool.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.engine.model.base import CausalLM
from pdcore.engine.model.batch import ForwardBatch
from pdcore.engine.model.hf_config import read_plain_config
from pdcore.engine.model.layers import linear
from pdcore.engine.model.llama import DecoderLayer
from pdcore.engine.model.rope import make_rotary
from pdcore.errors import ModelLoadError

EAGLE_ARCHS = ("LlamaForCausalLMEagle", "LlamaForCausalLM")


class TargetShared:
    """What a draft head borrows from its target model: the token embedding and the lm_head,
    unless its checkpoint holds its own (`embed`, `own_head`)."""

    _target: tuple[Any, ...]  # (the target,): a tuple, so not a submodule
    embed: nn.Embedding | None
    own_head: nn.Parameter | None

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed or self._target[0].embed_tokens)(ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the head's outputs `h` [R, hidden]."""
        if self.own_head is not None:
            return F.linear(h, self.own_head).float()
        t = self._target[0]
        return linear(h, t.lm_head, None, t.lm_head_packed).float()


class LlamaLayerPool:
    """The K/V pool geometry of a head whose one layer is a Llama-family decoder layer
    (`self.layer`): separate K and V with the layer's (per-rank) KV heads."""

    layer: Any

    @property
    def kv_heads(self) -> int:
        return self.layer.self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layer.self_attn.head_dim

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(heads, head_dim, latent) of the one-layer pool: separate K and V."""
        return self.kv_heads, self.head_dim, False


class EagleHead(TargetShared, LlamaLayerPool, nn.Module):
    name = "EAGLE"

    def __init__(self, cfg, target: CausalLM) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=True)
        # TP: the layer is sharded as the target's are (its K/V heads split alike, so in PD mode
        # its pool travels as one more layer of the target's per-rank geometry); fc is whole
        self.layer = DecoderLayer(cfg, target.tp, "llama")
        self.rotary = make_rotary(cfg)
        self._target = (target,)  # shared embedding / lm_head; a tuple: not a submodule
        self.embed: nn.Embedding | None = None  # the head's own, when its checkpoint has one
        self.own_head: nn.Parameter | None = None
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """The head's outputs [T, hidden] for the pairs (hidden[i], batch.input_ids[i]) at
        batch.positions; their K/V go into k_cache / v_cache at batch.out_slots."""
        e = self.embed_tokens(batch.input_ids).to(hidden.dtype)
        x = self.fc(torch.cat([e, hidden], dim=-1))
        cos, sin = self.rotary(x.unsqueeze(0), batch.positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1).to(x.dtype), sin[0].unsqueeze(1).to(x.dtype)
        layer = self.layer
        residual = x + layer.self_attn(x, cos, sin, k_cache, v_cache, batch)  # no input norm
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    @torch.inference_mode()
    def load(self, sd) -> None:
        def get(name: str) -> torch.Tensor | None:
            for key in (name, "model." + name):
                if key in sd:
                    return sd[key]
            return None

        def need(name: str) -> torch.Tensor:
            t = get(name)
            if t is None:
                raise ModelLoadError(f"the EAGLE draft head lacks the weight {name!r}")
            return t

        self.fc.weight.copy_(need("fc.weight"))
        bias = get("fc.bias")
        if bias is None:
            self.fc.bias = None
        else:
            self.fc.bias.copy_(bias)
        p = "layers.0."
        a = self.layer.self_attn
        names = ("q_proj", "k_proj", "v_proj")
        b = [get(p + f"self_attn.{n}.bias") for n in names]
        a.qkv.load([need(p + f"self_attn.{n}.weight") for n in names],
                   b if all(x is not None for x in b) else None)
        a.o_proj.load(need(p + "self_attn.o_proj.weight"))
        m = self.layer.mlp
        m.gate_up.load([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")])
        m.down.load(need(p + "mlp.down_proj.weight"))
        self.layer.post_attention_layernorm.weight.copy_(need(p + "post_attention_layernorm.weight"))
        embed = get("embed_tokens.weight")
        if embed is not None:
            self.embed = nn.Embedding(*embed.shape)
            self.embed.weight.requires_grad_(False)
            self.embed.weight.copy_(embed)
        lm = get("lm_head.weight")
        if lm is not None:
            self.own_head = nn.Parameter(lm.clone(), requires_grad=False)


def load_eagle_head(path: str, target: CausalLM, dtype: torch.dtype,
                    device: torch.device) -> EagleHead:
    """The draft head of the folder `path` beside `target` (checked against it)."""
    from pdcore.engine.model.fp8 import quantized_weights
    from pdcore.engine.model.weights import SafetensorsWeights

    cfg = read_plain_config(path, EAGLE_ARCHS)
    if cfg is None:
        raise ModelLoadError(f"--speculative-draft-model-path {path}: expected an HF folder "
                             f"whose config.json names one of {list(EAGLE_ARCHS)} "
                             "(model_type llama)")
    tcfg = target.cfg
    if cfg.num_hidden_layers != 1:
        raise ModelLoadError(f"{path}: the EAGLE head has {cfg.num_hidden_layers} layers; only "
                             "one-layer EAGLE-1 heads load from a draft folder (multi-layer "
                             "drafting: a MiMo's own MTP layers, --enable-multi-layer-eagle)")
    if cfg.hidden_size != tcfg.hidden_size or cfg.vocab_size != tcfg.vocab_size:
        raise ModelLoadError(f"{path}: the EAGLE head's hidden size / vocabulary "
                             f"({cfg.hidden_size}, {cfg.vocab_size}) differ from the target's "
                             f"({tcfg.hidden_size}, {tcfg.vocab_size})")
    head = EagleHead(cfg, target)
    head.load(quantized_weights(SafetensorsWeights(path), path))
    with torch.inference_mode():
        head = head.to(device=device, dtype=dtype).eval()
    return head
