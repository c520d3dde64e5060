"""DeepSeek-V2 / V3 forward pass over the paged KV pool: Multi-head Latent Attention (MLA) and
Mixture-of-Experts layers after the first `first_k_dense_replace` dense ones.

MLA caches one latent row per token and layer, [kv_lora_rank normalised | qk_rope_head_dim
rotated], shared by every attention head; that row is the whole KV of the token (the pool's
layout says `is_mla`). Attention runs in the latent space ("weight absorption"): each head's
no-RoPE query is multiplied into kv_b_proj's key half, so the cached rows serve directly as
keys of a one-KV-head attention, and the attention output is mapped to the head's value
through kv_b_proj's value half. This equals expanding the latents into per-head keys and values
(what transformers does) up to float rounding, and never materialises per-head K/V.

Tensor parallelism: every rank computes the same latent (the KV is identical on every rank, so
one prefill rank's pages serve every decode rank), query heads are split across ranks, and
o_proj all-reduces. MoE layers are the shared pdcore.engine.model.moe (TP or EP experts).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.engine.kv.cache import KVSpec
from pdcore.engine.model.base import CausalLM
from pdcore.engine.model.batch import DecodeGroup, ForwardBatch
from pdcore.engine.model.layers import (
    ColumnLinear,
    RMSNorm,
    RowLinear,
    TPInfo,
    pack_linears,
    span,
)
from pdcore.engine.model.llama import MLP
from pdcore.engine.model.moe import MoE, RouterSpec
from pdcore.engine.model.modelslim import as_float

SUPPORTED_ARCHS = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
_REPLICATED = TPInfo()  # layers every rank computes whole (the latent projections)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scale(cfg) -> float:
    """Softmax scale: 1/sqrt(qk_head_dim), times mscale(mscale_all_dim)^2 under yarn scaling
    (DeepSeek's long-context configs)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


class LatentRotary(nn.Module):
    """cos/sin [T, rope_dim/2] of each position, with transformers' own inverse frequencies and
    attention factor for the config's rope type (default, yarn, ...)."""

    def __init__(self, cfg, arch: str) -> None:
        super().__init__()
        if arch == "deepseek_v2":
            from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
                DeepseekV2RotaryEmbedding as Rotary,
            )
        else:
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
                DeepseekV3RotaryEmbedding as Rotary,
            )
        ref = Rotary(cfg)
        self.register_buffer("inv_freq", ref.inv_freq.detach().clone().float(), persistent=False)
        self.factor = float(ref.attention_scaling)
        # V2 rotates interleaved pairs (x0, x1), (x2, x3)...; V3 too unless rope_interleave=False
        self.interleave = arch == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.factor, freqs.sin() * self.factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, rope_dim]; the output lists the pairs' first then second halves
        (the same order for queries and keys, so dot products are those of the reference)."""
        if self.interleave:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            a, b = x.chunk(2, dim=-1)
        c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg, tp: TPInfo) -> None:
        super().__init__()
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.lora, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        self.latent_dim = self.lora + self.rope
        qk = self.nope + self.rope
        heads = cfg.num_attention_heads
        self.h0, self.num_heads = span(heads, tp.rank, tp.size)
        if self.num_heads == 0:
            raise ValueError(f"--tp-size {tp.size} exceeds the model's {heads} attention heads")
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_lora = cfg.q_lora_rank
        q_shard = [(self.h0 * qk, self.num_heads * qk)]
        if self.q_lora:
            self.q_a = ColumnLinear(cfg.hidden_size, [self.q_lora], bias, _REPLICATED)
            self.q_a_norm = RMSNorm(self.q_lora, 1e-6)
            self.q_b = ColumnLinear(self.q_lora, [heads * qk], False, tp, shards=q_shard)
        else:
            self.q_proj = ColumnLinear(cfg.hidden_size, [heads * qk], False, tp, shards=q_shard)
        self.kv_a = ColumnLinear(cfg.hidden_size, [self.latent_dim], bias, _REPLICATED)
        self.kv_a_norm = RMSNorm(self.lora, 1e-6)
        # kv_b_proj split per head into its key half [nope, lora] and value half [v, lora]
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope, self.lora),
                                 requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.v_dim, self.lora),
                                 requires_grad=False)
        self.o_proj = RowLinear(heads * self.v_dim, cfg.hidden_size, bias, tp,
                                shard=(self.h0 * self.v_dim, self.num_heads * self.v_dim))
        self.scale = attention_scale(cfg)

    def load(self, get, opt, p: str) -> None:
        if self.q_lora:
            self.q_a.load([get(p + "q_a_proj.weight")], _bias(opt, p + "q_a_proj.bias"))
            self.q_a_norm.weight.copy_(get(p + "q_a_layernorm.weight"))
            self.q_b.load([get(p + "q_b_proj.weight")])
        else:
            self.q_proj.load([get(p + "q_proj.weight")])
        self.kv_a.load([get(p + "kv_a_proj_with_mqa.weight")],
                       _bias(opt, p + "kv_a_proj_with_mqa.bias"))
        self.kv_a_norm.weight.copy_(get(p + "kv_a_layernorm.weight"))
        # absorbed into the query and the output per head, so kept float (an int8 one
        # de-quantized here: weight-only int8, as SGLang's MLA does with it)
        kv_b = as_float(get(p + "kv_b_proj.weight")).view(-1, self.nope + self.v_dim, self.lora)
        mine = kv_b[self.h0 : self.h0 + self.num_heads]
        self.w_uk.copy_(mine[:, : self.nope])
        self.w_uv.copy_(mine[:, self.nope :])
        self.o_proj.load(get(p + "o_proj.weight"), opt(p + "o_proj.bias"))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: LatentRotary, cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = h.shape[0]
        q = self.q_b(self.q_a_norm(self.q_a(h))) if self.q_lora else self.q_proj(h)
        q = q.view(T, self.num_heads, self.nope + self.rope)
        latent = self.kv_a(h)
        c = self.kv_a_norm(latent[:, : self.lora])
        k_pe = rotary.apply(latent[:, None, self.lora :], cos, sin)[:, 0]
        q_pe = rotary.apply(q[..., self.nope :], cos, sin)
        flat = cache.view(-1, self.latent_dim)  # [pages * page_size, latent]: one row per slot
        flat[batch.out_slots] = torch.cat((c, k_pe), dim=-1).to(flat.dtype)
        # absorbed query: [T, heads, lora] in the latent space, then the RoPE part
        q_lat = torch.einsum("thn,hnl->thl", q[..., : self.nope], self.w_uk)
        qq = torch.cat((q_lat, q_pe), dim=-1)
        out = torch.empty(T, self.num_heads, self.latent_dim, dtype=qq.dtype, device=qq.device)
        group = batch.decode_group()
        if group is not None and len(group.seqs) < 2:
            group = None  # a lone decode: per sequence, below (as before groups of one)
        if group is not None:
            self._decode_attention(qq, flat, group, out)
        for s in batch.seqs:
            if group is not None and s.q_len == 1:
                continue
            qi = qq[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [H, n, D]
            ki = flat[s.ctx_slots].to(qq.dtype)[None]  # [1, ctx, D]: one KV head
            n, ctx = s.q_len, ki.shape[1]
            mask = None
            if n > 1:
                pos = torch.arange(ctx, device=qq.device)
                mask = pos.unsqueeze(0) <= pos[ctx - n :].unsqueeze(1)
            o = F.scaled_dot_product_attention(qi[None], ki[None], ki[None], attn_mask=mask,
                                               scale=self.scale, enable_gqa=True)
            out[s.q_start : s.q_start + n] = o[0].transpose(0, 1)
        # values are the latents' first `lora` columns, mapped per head through w_uv
        o = torch.einsum("thl,hvl->thv", out[..., : self.lora], self.w_uv)
        return self.o_proj(o.reshape(T, -1))

    def _decode_attention(self, qq: torch.Tensor, flat: torch.Tensor, g: DecodeGroup,
                          out: torch.Tensor) -> None:
        B, W = len(g.seqs), g.width
        kb = flat.index_select(0, g.table).view(B, 1, W, self.latent_dim).to(qq.dtype)
        qb = qq.index_select(0, g.rows).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qb, kb, kb, attn_mask=g.mask, scale=self.scale,
                                           enable_gqa=True)
        out[g.rows] = o[:, :, 0]


def _bias(opt, name: str) -> list[torch.Tensor] | None:
    b = opt(name)
    return None if b is None else [b]


class DecoderLayer(nn.Module):
    def __init__(self, cfg, tp: TPInfo, index: int, arch: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = index >= cfg.first_k_dense_replace
        self.mlp = deepseek_moe(cfg, tp, arch) if self.is_moe else MLP(cfg, tp)


def deepseek_moe(cfg, tp: TPInfo, arch: str) -> MoE:
    """V2: softmax scores, top-k over all experts or over the topk_group groups with the best
    expert (group_limited_greedy), not renormalised. V3: sigmoid scores, selection with the
    correction bias among the groups with the best two-expert sums, renormalised. Both scale
    the weights by routed_scaling_factor; shared experts are n_shared_experts experts wide."""
    v3 = arch == "deepseek_v3"
    grouped = v3 or getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
    spec = RouterSpec(top_k=cfg.num_experts_per_tok, scoring="sigmoid" if v3 else "softmax",
                      renormalize=v3 and bool(cfg.norm_topk_prob), renorm_eps=1e-20,
                      num_groups=(cfg.n_group or 1) if grouped else 1,
                      topk_groups=(cfg.topk_group or 1) if grouped else 1,
                      group_score="top2_sum" if v3 else "max", correction_bias=v3,
                      scaling=float(cfg.routed_scaling_factor))
    return MoE(cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, spec, tp,
               ep_size=getattr(tp, "ep_size", 1),
               shared_inter=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
               act=cfg.hidden_act)


class DeepseekForCausalLM(CausalLM):
    def __init__(self, cfg, tp: TPInfo | None = None) -> None:
        super().__init__(cfg, tp, SUPPORTED_ARCHS[cfg.architectures[0]])
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp, i, self.arch)
                                    for i in range(cfg.num_hidden_layers))
        self.rotary = LatentRotary(cfg, self.arch)

    def kv_spec(self) -> KVSpec:
        """The pool this model needs per layer: one latent 'head' on every rank, not sharded."""
        return KVSpec(kv_heads=1, head_dim=self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim,
                      total_kv_heads=1, is_mla=True)

    def prepare_for_inference(self) -> None:
        pack_linears(self)
        self.pack_lm_head()

    def begin(self, h: torch.Tensor, batch: ForwardBatch,
              kv: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, ...]:
        cos, sin = self.rotary(batch.positions)
        return cos, sin, kv, batch

    def attend(self, layer: nn.Module, i: int, x: torch.Tensor, step: tuple[Any, ...]
               ) -> torch.Tensor:
        cos, sin, kv, batch = step
        return layer.self_attn(x, cos, sin, self.rotary, kv[i][0], batch)

    @torch.inference_mode()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.load_outer(sd)
        for i, layer in enumerate(self.layers):
            load_layer(layer, sd, f"model.layers.{i}.")


def load_layer(layer: DecoderLayer, sd: dict[str, torch.Tensor], p: str) -> None:
    """One decoder layer's weights from the checkpoint names under `p` ('model.layers.3.'):
    the model's layers and its MTP layer's (engine/model/nextn.py)."""
    def get(name: str) -> torch.Tensor:
        return sd[name]

    layer.self_attn.load(get, sd.get, p + "self_attn.")
    if layer.is_moe:
        layer.mlp.load_hf(sd, p + "mlp.")
    else:
        layer.mlp.gate_up.load([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        layer.mlp.down.load(get(p + "mlp.down_proj.weight"))
    layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
    layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))
