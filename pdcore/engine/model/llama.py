"""Llama-family forward pass (Llama, SmolLM, Mistral, Qwen2, Qwen3) over the paged KV pool.

Tokens of all sequences in a step are packed into one [T, hidden] tensor (prefill chunks and
decode tokens mixed); linear layers run once over the pack. Attention reads K/V gathered from the
pool by slot index: the decode sequences of a step (one new token each) together, as one padded
[B, heads, ctx_max, dim] gather and one masked SDPA per layer, and each prefill chunk on its own.
A decode-only step of keyed sequences reads the decode K/V view instead (decode_view.py): the
contexts kept contiguous between steps, so a steady step appends its new K/V, no gather
(in mixed steps too: the decodes riding along a prefill chunk append as well).
New K/V are written into the pool before attention reads it, so a chunk attends to itself and
to everything cached before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.engine.kv.fp8 import dequantize, is_fp8, store_rows
from pdcore.engine.model.base import CausalLM, _native_op
from pdcore.engine.model.batch import DecodeGroup, ForwardBatch, VerifyGroup
from pdcore.engine.model.decode_view import (PAGED as _PAGED, POOLS as _POOLS, DecodeKV, bf16_pool,
                                              reads_in_place, widened)
from pdcore.engine.model.layers import (ColumnLinear, RMSNorm, RowLinear, TPInfo, kv_head_span,
                                        pack_linears, q_head_span)
from pdcore.engine.model import prefill_route

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _native_for(name: str, x: torch.Tensor):
    """_native_op(name) for a step whose tensors are on the CPU; None elsewhere: the kernels are
    host code (registered for every backend), so given CUDA tensors they would dereference
    device pointers on the CPU."""
    return _native_op(name) if x.device.type == "cpu" else None


# SDPA's CPU flash kernel, which also returns each query's log-sum-exp (None: not this torch)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _after_prefix(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor,
                  vc: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a prefill chunk's queries q [H, n, d] that follows a prefix: every prefix
    key (kp, vp [KVH, p, d]) visible, the chunk's own keys (kc, vc [KVH, n, d]) causally.
    Two flash passes, the prefix's without a mask and the chunk's with the kernel's own causal
    skip, combined by their log-sum-exps (exact up to rounding). One masked SDPA over the whole
    context computed every masked block too: at 8k tokens of context, chunk 2048, this took
    ~25% less time (bench/long_context.py). Returns [H, n, d]."""
    o1, l1 = _FLASH(q[None], kp[None], vp[None], 0.0, False, scale=scale)
    o2, l2 = _FLASH(q[None], kc[None], vc[None], 0.0, True, scale=scale)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_().unsqueeze(-1), (l2 - m).exp_().unsqueeze(-1)
    o = (o1.float() * w1).add_(o2.float() * w2).div_(w1 + w2)
    return o[0].to(q.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, tp: TPInfo, arch: str) -> None:
        super().__init__()
        hd = self.head_dim = (getattr(cfg, "head_dim", None)
                              or cfg.hidden_size // cfg.num_attention_heads)
        q0, self.num_heads = q_head_span(cfg.num_attention_heads, cfg.num_key_value_heads,
                                         tp.rank, tp.size)
        k0, self.num_kv_heads = kv_head_span(cfg.num_key_value_heads, tp.rank, tp.size)
        # Qwen2(-MoE) has q/k/v biases (Qwen2-MoE's config says so in qkv_bias)
        bias = (bool(getattr(cfg, "qkv_bias", arch == "qwen2"))
                or bool(getattr(cfg, "attention_bias", False)))
        qd, kvd = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        kv_shard = (k0 * hd, self.num_kv_heads * hd)
        self.qkv = ColumnLinear(cfg.hidden_size, [qd, kvd, kvd], bias, tp,
                                shards=[(q0 * hd, self.num_heads * hd), kv_shard, kv_shard])
        self.o_proj = RowLinear(qd, cfg.hidden_size, False, tp, shard=(q0 * hd, self.num_heads * hd))
        self.qk_norm = arch == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.layer_id = 0  # set by the model: this layer's buffers in the decode K/V view
        # an FP8 pool's per-layer scales (kv/fp8.py): the checkpoint's k_scale / v_scale, else 1
        self.k_scale, self.v_scale = 1.0, 1.0
        self.sdpa_from = prefill_route.NEVER  # chunks this long take SDPA (prefill_route.py)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = h.shape[0]
        qkv = self.qkv(h)
        qs, ks = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :qs].view(T, self.num_heads, self.head_dim)
        k = qkv[:, qs : qs + ks].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, qs + ks :].view(T, self.num_kv_heads, self.head_dim)
        stored = False  # k and v already in the pool
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        else:  # q and k are neighbours in qkv: one rotary over both
            # the native store casts (an FP8 pool: unscaled); scaled FP8 takes the Python store
            scaled = self.k_scale != 1.0 or self.v_scale != 1.0
            rope = None if scaled and is_fp8(k_cache.dtype) else _native_for("rope_store", qkv)
            if rope is not None:  # fused with the pool store, equal to the bit (engine/native)
                qk = rope(qkv, cos, sin, k_cache, v_cache, batch.out_slots, self.num_heads,
                          self.num_kv_heads, self.head_dim)
                stored = True
            else:
                qk = qkv[:, : qs + ks].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
                qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        # the pool is [pages, page_size, heads, dim]; as slots it is [pages*page_size, heads, dim]
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        if not stored:
            # a row scatter (FP8: quantized with the layer's scales, kv/fp8.py)
            store_rows(k_flat, batch.out_slots, k, self.k_scale)
            store_rows(v_flat, batch.out_slots, v, self.v_scale)
        group = batch.decode_group()
        if group is not None and group.whole:  # a decode-only step: its rows are the pack
            out = self._decode(q, k, v, k_flat, v_flat, group, batch=batch)
            return self.o_proj(out.view(T, -1))
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if group is not None:
            out[group.rows] = self._decode(q, k, v, k_flat, v_flat, group, batch=batch)
        vg = batch.verify_group()
        if vg is not None:
            out[vg.rows[vg.real]] = self._verify(q, k_flat, v_flat, vg)[vg.real]
        for s in batch.seqs:
            if group is not None and s.q_len == 1 or s.verify:
                continue
            n, ctx = s.q_len, len(s.ctx_slots)
            a, b = s.q_start, s.q_start + n
            paged = self._paged(q, k_flat) if n == 1 else None
            # a decode outside a group (only where decode_group is switched off: bench/
            # engine_profile's per-sequence attention): its context read in place
            if paged is not None:
                kvh = self.num_kv_heads
                qb = q[a:b].reshape(1, kvh, self.num_heads // kvh, self.head_dim)
                out[a:b] = paged(qb, k_flat, v_flat, s.ctx_slots.contiguous(), None, self.scale,
                                 self.k_scale, self.v_scale).reshape(1, self.num_heads,
                                                                     self.head_dim)
                continue
            # the native causal kernel (the pool read in place), but SDPA for chunks of at least
            # sdpa_from tokens (prefill_route: bf16 on AMX; its rows differ in bits from decode's)
            native = self._prefill_native(q, k_flat) if 1 < n and (
                n < self.sdpa_from or k_flat.dtype != q.dtype) else None
            if native is not None:
                native(q[a:b], k_flat, v_flat, s.ctx_slots, self.scale, self.k_scale,
                       self.v_scale, self.num_kv_heads, out[a:b])  # written in place
                batch.native_prefill += self.layer_id == 0
                continue
            qi = q[a:b].transpose(0, 1)  # [H, n, d]
            mask = None
            if 1 < n < ctx and k_flat.dtype == q.dtype and _FLASH is not None \
                    and q.device.type == "cpu":
                # a chunk after its prefix: the prefix's K/V gathered (no mask: all visible),
                # the chunk's own from this step (causal), merged by their log-sum-exps
                pre = s.ctx_slots[: ctx - n]
                kp = k_flat.index_select(0, pre).transpose(0, 1)
                vp = v_flat.index_select(0, pre).transpose(0, 1)
                out[a:b] = _after_prefix(qi, kp, vp, k[a:b].transpose(0, 1),
                                         v[a:b].transpose(0, 1), self.scale).transpose(0, 1)
                continue
            if n == ctx and k_flat.dtype == q.dtype:
                # the chunk is its whole context: its K/V are this step's rows as written to
                # the pool (no gather), and the causal mask is SDPA's own (no mask tensor)
                ki, vi = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)  # [KVH, ctx, d]
            else:
                ki = dequantize(k_flat[s.ctx_slots].transpose(0, 1), q.dtype, self.k_scale)
                vi = dequantize(v_flat[s.ctx_slots].transpose(0, 1), q.dtype, self.v_scale)
                if n > 1:
                    # query i sits at position ctx-n+i and may see keys 0..ctx-n+i
                    qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
                    mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask,
                is_causal=mask is None and n > 1, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[a:b] = o[0].transpose(0, 1)
        return self.o_proj(out.view(T, -1))

    def _verify(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                g: VerifyGroup) -> torch.Tensor:
        """Attention of the verify sequences in one SDPA; [B * qmax, H, D] (padding included).
        A KV head's query heads go in as its query rows ([B, KVH, group * qmax, D])."""
        kvh, d, hq = self.num_kv_heads, self.head_dim, self.num_heads
        grp, B = hq // kvh, g.rows.numel() // g.qmax
        qb = q.index_select(0, g.rows).view(B, g.qmax, kvh, grp, d).permute(0, 2, 3, 1, 4)
        qb = qb.reshape(B, kvh, grp * g.qmax, d)
        shape = (B, g.width, kvh, d)
        kb = dequantize(k_flat.index_select(0, g.table).view(shape).transpose(1, 2), q.dtype,
                        self.k_scale)
        vb = dequantize(v_flat.index_select(0, g.table).view(shape).transpose(1, 2), q.dtype,
                        self.v_scale)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.grouped_bias(q.dtype, grp),
                                           scale=self.scale)
        o = o.reshape(B, kvh, grp, g.qmax, d).permute(0, 3, 1, 2, 4)  # [B, qmax, KVH, grp, D]
        return o.reshape(B * g.qmax, hq, d)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor,
                v_flat: torch.Tensor, g: DecodeGroup, *, batch: ForwardBatch) -> torch.Tensor:
        """Attention of the step's one-token sequences: through the decode K/V view when this
        forward uses it, else gathered from the pool. Returns [B, H, D]."""
        view = batch.kv_view
        if view is None:
            return self._decode_attention(q, k_flat, v_flat, g)
        if not g.whole:
            q, k, v = (t.index_select(0, g.rows) for t in (q, k, v))
        kb, vb = view.layer(self.layer_id, k, v, k_flat, v_flat, g,
                            scales=(self.k_scale, self.v_scale))
        return self._grouped_sdpa(q, kb, vb, g)

    def _decode_attention(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                          g: DecodeGroup) -> torch.Tensor:
        """One masked SDPA over every one-token sequence: K/V rows gathered with index_select
        (a plain row gather, cheaper than advanced indexing) into [B, KVH, W, D]. The query
        heads of one KV head go in as that head's "query rows" ([B, KVH, group, D]): no GQA
        expansion, measured 1.3x faster than SDPA's enable_gqa here. Returns [B, H, D]."""
        B, W, kvh, d = len(g.seqs), g.width, self.num_kv_heads, self.head_dim
        qs = q if g.whole else q.index_select(0, g.rows)
        paged = self._paged(qs, k_flat)
        if paged is not None:  # the pool read in place: no gather
            qb = qs.reshape(B, kvh, self.num_heads // kvh, d)
            return paged(qb, k_flat, v_flat, g.table, g.bias(qb.dtype), self.scale, self.k_scale,
                         self.v_scale).reshape(B, self.num_heads, d)
        kb = dequantize(k_flat.index_select(0, g.table).view(B, W, kvh, d).transpose(1, 2),
                        q.dtype, self.k_scale)
        vb = dequantize(v_flat.index_select(0, g.table).view(B, W, kvh, d).transpose(1, 2),
                        q.dtype, self.v_scale)
        return self._grouped_sdpa(qs, kb, vb, g)

    @staticmethod
    def _paged(q: torch.Tensor, k_flat: torch.Tensor):
        """The native paged decode attention where it reads this pool as it is (on the CPU, a
        float32 or bf16 model, a contiguous float32, bf16 or FP8 pool: widened as read, FP8
        times the scale), else None. bf16 queries go in as float32 and the output comes back
        in bf16, as through a bf16 model's float32 decode view: the same bits."""
        if q.dtype not in _PAGED or k_flat.dtype not in _POOLS or not k_flat.is_contiguous():
            return None
        fn = _native_for("decode_attention_paged", q)
        return fn if fn is None or q.dtype == torch.float32 else widened(fn)

    def _prefill_native(self, q: torch.Tensor, k_flat: torch.Tensor):
        """The native causal prefill attention (engine/native: prefill_attention_paged) where
        it reads this pool as it is (float32 or bf16 queries; a float32, bf16 or FP8 pool,
        contiguous; head_dim a multiple of 16) on the CPU, else None (SDPA then)."""
        if q.dtype not in (torch.float32, torch.bfloat16) or self.head_dim % 16 \
                or self.num_heads % self.num_kv_heads or not k_flat.is_contiguous() \
                or k_flat.dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                        torch.float8_e5m2):
            return None
        return _native_for("prefill_attention_paged", q)

    def _grouped_sdpa(self, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                      g: DecodeGroup) -> torch.Tensor:
        """q [B, H, D] against kb/vb [B, KVH, W, D] -> [B, H, D]."""
        B, kvh, d = len(g.seqs), self.num_kv_heads, self.head_dim
        # in the buffers' dtype: a bf16 model's decode K/V view is float32 (see LlamaForCausalLM)
        qb = q.reshape(B, kvh, self.num_heads // kvh, d).to(kb.dtype)
        attend = _native_for("decode_attention", qb)
        if attend is not None:  # the native kernel (SDPA itself where it does not apply)
            o = attend(qb, kb, vb, g.bias(qb.dtype), self.scale)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.bias(qb.dtype),
                                               scale=self.scale)
        return o.reshape(B, self.num_heads, d).to(q.dtype)


def _kv_scale(sd: dict[str, torch.Tensor], prefix: str, which: str) -> float:
    """A layer's FP8 KV scale from the checkpoint (SGLang's names: `k_scale`, compressed-
    tensors' `k_proj.output_scale`), else 1.0; used only by an FP8 pool."""
    for name in (f"{which}_scale", f"{which}_proj.output_scale", f"attn.{which}_scale"):
        t = sd.get(prefix + name)
        if t is not None:
            return float(t.float().reshape(-1)[0])
    return 1.0


class MLP(nn.Module):
    def __init__(self, cfg, tp: TPInfo) -> None:
        super().__init__()
        self.gate_up = ColumnLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, tp)
        self.inter = self.gate_up.shards[0][1]
        self.down = RowLinear(cfg.intermediate_size, cfg.hidden_size, False, tp,
                              shard=self.gate_up.shards[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        fused = _native_for("silu_mul", gu)
        if fused is not None:  # one pass (engine/native; the native decode loop calls it too)
            return self.down(fused(gu, self.inter))
        return self.down(F.silu(gu[:, : self.inter]) * gu[:, self.inter :])


class DecoderLayer(nn.Module):
    def __init__(self, cfg, tp: TPInfo, arch: str, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp, arch)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg, tp)


@dataclass
class LlamaStep:
    """What every layer of one forward reads: rotary tables, the pool, the batch, and the
    decode K/V view when this step uses it."""

    cos: torch.Tensor
    sin: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    batch: ForwardBatch
    view: DecodeKV | None
    view_dtype: torch.dtype


class LlamaForCausalLM(CausalLM):
    ARCHS = SUPPORTED_ARCHS  # subclasses (MoE families) swap in their own table and MLPs

    def __init__(self, cfg, tp: TPInfo | None = None) -> None:
        super().__init__(cfg, tp, self.ARCHS[(cfg.architectures or ["LlamaForCausalLM"])[0]])
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp, self.arch,
                                                 self._make_mlp(cfg, i))
                                    for i in range(cfg.num_hidden_layers))
        self.rotary = self._make_rotary(cfg)
        self.native: dict | None = None  # the native decode step's weight lists (prepare_...)
        self.native_steps = 0  # decode steps that ran the native layer loop
        self.native_prefill_chunks = 0  # prefill chunks attended by the native kernel
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_id = i
        a = self.layers[0].self_attn if len(self.layers) else None
        self.decode_kv = (DecodeKV(len(self.layers), a.num_kv_heads, a.head_dim)
                          if isinstance(a, Attention) else None)

    def _make_mlp(self, cfg, layer: int) -> nn.Module | None:
        """The feed-forward block of `layer`; None: the dense MLP."""
        return None

    def _load_mlp(self, mlp: nn.Module, sd: dict[str, torch.Tensor], prefix: str) -> None:
        """Weights of one layer's feed-forward block; `prefix` is e.g. 'model.layers.3.mlp.'."""
        mlp.gate_up.load([sd[prefix + "gate_proj.weight"], sd[prefix + "up_proj.weight"]])
        mlp.down.load(sd[prefix + "down_proj.weight"])

    def prepare_for_inference(self) -> None:
        """After the weights are loaded and placed: prepack small-batch CPU GEMMs (layers.py),
        then the native decode step where this model can use it."""
        pack_linears(self)
        self.pack_lm_head()
        self.native = self._native_plan()
        prefill_route.apply(self)  # which kernel attends prefill chunks (logged once)

    def _native_plan(self) -> dict | None:
        """The per-layer weight lists of the native decode step (engine/native), or None where
        it does not apply: it covers the dense Llama layer on one TP rank with every GEMM
        packed; anything else (MoE, Qwen3's q/k norm, TP, an unpacked weight) keeps the
        Python loop."""
        layers = list(self.layers)
        if not layers or self.tp.size != 1:
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if type(a) is not Attention or type(m) is not MLP or a.qk_norm:
                return None
            if any(x.packed is None for x in (a.qkv, a.o_proj, m.gate_up, m.down)):
                return None
            if a.o_proj.bias is not None or m.down.bias is not None:
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != dtype for n in norms):
                return None
        op = _native_op("decode_layers")
        if op is None:
            return None
        a0 = layers[0].self_attn
        empty = torch.empty(0)
        return {
            "op": op,
            "ln1": [x.input_layernorm.weight for x in layers],
            "ln2": [x.post_attention_layernorm.weight for x in layers],
            "qkv_w": [x.self_attn.qkv.packed for x in layers],
            "qkv_b": [x.self_attn.qkv.bias if x.self_attn.qkv.bias is not None else empty
                      for x in layers],
            "o_w": [x.self_attn.o_proj.packed for x in layers],
            "gu_w": [x.mlp.gate_up.packed for x in layers],
            "down_w": [x.mlp.down.packed for x in layers],
            # an FP8 pool's K/V are cast unscaled in C++: scaled layers keep the Python loop
            "unit_scales": all(x.self_attn.k_scale == 1.0 and x.self_attn.v_scale == 1.0
                               for x in layers),
            "shape": (a0.num_heads, a0.num_kv_heads, a0.head_dim, layers[0].mlp.inter,
                      float(layers[0].input_layernorm.eps), float(a0.scale)),
            # W8A8: the int8 GEMMs' inputs quantized in the norm / silu_mul pass that makes
            # them (native int8_act.h), 2: and the step in one parallel region (team_step.h),
            # the same bits; 1: per operator; 0 / False: the separate operators (benches)
            "int8_fused": 2,
        }

    def _native_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                       g: DecodeGroup, *, view: DecodeKV | None, view_dtype: torch.dtype
                       ) -> torch.Tensor:
        """The layer loop of a decode-only step through the decode K/V view, or without one
        (view None: a float32 or bf16 pool read in place), in C++: the residual stream after
        the last layer, equal to the Python loop's to the bit."""
        p = self.native
        bias = g.bias(view_dtype)
        empty = torch.empty(0, dtype=torch.long)
        append = view is not None and view.mode == "append"
        mode = 2 if view is None else 0 if append else 1  # 2: the pool read in place (paged)
        return p["op"](
            h, cos, sin, p["ln1"], p["ln2"], p["qkv_w"], p["qkv_b"], p["o_w"], p["gu_w"],
            p["down_w"], [k for k, _ in kv], [v for _, v in kv],
            [] if view is None else view.k, [] if view is None else view.v,
            batch.out_slots, view.rows if append else empty, view.cols if append else empty,
            empty if append else g.table, bias if bias is not None else torch.empty(0),
            mode, g.width, *p["shape"], int(p["int8_fused"]))

    @staticmethod
    def _make_rotary(cfg) -> nn.Module:
        # transformers' inverse frequencies (and rope scaling), without its model module (rope.py)
        from pdcore.engine.model.rope import make_rotary

        return make_rotary(cfg)

    def begin(self, h: torch.Tensor, batch: ForwardBatch,
              kv: list[tuple[torch.Tensor, torch.Tensor]]) -> LlamaStep:
        cos, sin = self.rotary(h.unsqueeze(0), batch.positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1).to(h.dtype), sin[0].unsqueeze(1).to(h.dtype)
        # a half-precision model's decode view holds float32 (exact copies of the pool's
        # values): CPU SDPA over it took 145 us a layer at batch 8 against 180 us in bf16, and
        # attention then rounds once instead of per step
        view_dtype = torch.float32 if h.dtype in (torch.bfloat16, torch.float16) else h.dtype
        view = None
        dkv = self.decode_kv
        if dkv is not None and dkv.begin(batch, view_dtype, in_place=bool(kv) and (
                dkv.prefer_pool or bf16_pool(h, kv[0][0])) and reads_in_place(h, kv[0][0])):
            view = batch.kv_view = self.decode_kv
        return LlamaStep(cos, sin, kv, batch, view, view_dtype)

    def attend(self, layer: nn.Module, i: int, x: torch.Tensor, step: LlamaStep
               ) -> torch.Tensor:
        return layer.self_attn(x, step.cos, step.sin, step.kv[i][0], step.kv[i][1], step.batch)

    def fast_layers(self, h: torch.Tensor, step: LlamaStep) -> torch.Tensor | None:
        """The native decode step (engine/native: run_layers fused for the dense layer, equal
        to it to the bit) for a decode-only step, through the decode K/V view or (no view: over
        its budget, or turned off) reading a float32 or bf16 pool in place."""
        group = step.batch.decode_group()
        if self.native is None or group is None or not group.whole \
                or (not self.native["unit_scales"] and is_fp8(step.kv[0][0].dtype)):
            return None
        if step.view is None and (step.kv[0][0].dtype not in _POOLS or h.dtype not in _PAGED):
            return None  # no view: the paged kernel reads float32, bf16 and FP8 pools only
        self.native_steps += 1
        return self._native_layers(h, step.cos, step.sin, step.kv, step.batch, group,
                                   view=step.view, view_dtype=step.view_dtype)

    def end(self, step: LlamaStep) -> None:
        self.native_prefill_chunks += step.batch.native_prefill
        if self.decode_kv is not None:
            self.decode_kv.end()

    @torch.inference_mode()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        def get(name: str) -> torch.Tensor:
            return sd[name]

        def opt(name: str) -> torch.Tensor | None:
            return sd.get(name)

        self.load_outer(sd)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            names = ("q_proj", "k_proj", "v_proj")
            w = [get(p + f"self_attn.{n}.weight") for n in names]
            b = [opt(p + f"self_attn.{n}.bias") for n in names]
            a.qkv.load(w, b if all(x is not None for x in b) else None)
            a.o_proj.load(get(p + "self_attn.o_proj.weight"))
            a.k_scale, a.v_scale = (_kv_scale(sd, p + "self_attn.", x) for x in "kv")
            if a.qk_norm:
                a.q_norm.weight.copy_(get(p + "self_attn.q_norm.weight"))
                a.k_norm.weight.copy_(get(p + "self_attn.k_norm.weight"))
            self._load_mlp(layer.mlp, sd, p + "mlp.")
            layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))
