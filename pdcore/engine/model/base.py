"""What every model family shares: the token embedding, the forward pass and its layer loop
(pre-norm: the residual stream plus attention of its norm, then plus the MLP of its norm), the
final norm and the lm_head (packed for small-batch GEMMs), the logits of the wanted rows, and
those weights from an HF checkpoint. A family supplies its layers (`self.layers`, each with
input_layernorm, self_attn, post_attention_layernorm, mlp), how a layer's attention is called
(`attend`), what a step prepares for every layer (`begin`: rotary tables, views) and its
weights; `fast_layers` may run the whole loop another way (the native decode step)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from pdcore.engine.model.batch import ForwardBatch
from pdcore.engine.model import gguf_packed
from pdcore.engine.model.layers import RMSNorm, TPInfo, linear, pack_in_place, stand_in
from pdcore.engine.model.weights import adopt


@functools.cache
def _native_op(name: str):
    """pdcore_native::<name> where the native kernels are built, else None; resolved once per
    name (the decode attention, rope_store, silu_mul and add_rms_norm ops are asked for in every
    layer of every step; llama.py uses it too)."""
    from pdcore.engine import native

    return native.op(name)


def add_norm(residual: torch.Tensor, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """residual += x (in place), then norm(residual). A float32 RMSNorm on the CPU runs both in
    one native pass (pdcore_native::add_rms_norm, equal to the bit to aten's add_ and rms_norm:
    at 4 x 512 tokens of SmolLM2 the two took ~11% of a prefill forward, six passes over the
    rows and five temporaries for the norm alone); anything else runs the two as before."""
    if (type(norm) is RMSNorm and residual.dtype == torch.float32 == norm.weight.dtype
            and residual.device.type == "cpu"):
        op = _native_op("add_rms_norm")
        if op is not None:
            return op(residual, x, norm.weight, norm.eps)
    residual.add_(x)
    return norm(residual)


class CausalLM(nn.Module):
    def __init__(self, cfg: Any, tp: TPInfo | None, arch: str) -> None:
        super().__init__()
        self.cfg, self.tp, self.arch = cfg, tp or TPInfo(), arch
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size),
                                    requires_grad=False)
        self.lm_head_packed: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: list[tuple[torch.Tensor, torch.Tensor]],
                logits: bool = True) -> torch.Tensor | None:
        """Logits [R, vocab] of batch.logit_rows; None when `logits` is False (TP ranks other
        than 0 run the layers for their shards and leave sampling to rank 0)."""
        h = self.embed_tokens(batch.input_ids)
        step = self.begin(h, batch, kv)
        # EAGLE3: the residual streams entering these layers, concatenated (their rows go to
        # batch.hidden); only the Python loop stops there, so such a step skips
        # fast_layers (the native decode loop), which every other step still takes
        aux = batch.capture_layers
        taps: dict[int, torch.Tensor | None] | None = dict.fromkeys(aux) if aux else None
        residual = self.fast_layers(h, step) if taps is None else None
        if residual is None:
            residual = self.run_layers(h, step, taps)
        self.end(step)
        if taps is not None:
            batch.hidden = torch.cat([taps[i] for i in aux], dim=-1)
        return self.logits_of(residual, batch, logits)

    def run_layers(self, h: torch.Tensor, step: Any,
                   taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """The layer loop, once for every family: the residual stream after the last layer.
        `taps` (EAGLE3): its keys i get a copy of the residual stream entering layer i (i = 0:
        the embedding; i = the layer count: the stream after the last layer)."""
        residual = h
        layers = list(self.layers)
        normed = layers[0].input_layernorm(h) if layers else h
        for i, layer in enumerate(layers):
            if taps is not None and i in taps:
                taps[i] = residual.clone()  # the loop adds into it in place
            x = self.attend(layer, i, normed, step)
            if i == 0:
                residual = residual.clone()  # h is the embedding's
            normed = add_norm(residual, x, layer.post_attention_layernorm)
            x = layer.mlp(normed)
            if i + 1 < len(layers):  # the next layer's input norm, in the same pass
                normed = add_norm(residual, x, layers[i + 1].input_layernorm)
            else:
                residual.add_(x)
        if taps is not None and len(self.layers) in taps:
            taps[len(self.layers)] = residual
        return residual

    def begin(self, h: torch.Tensor, batch: ForwardBatch,
              kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """What every layer of this step reads (the family's step state)."""
        raise NotImplementedError

    def attend(self, layer: nn.Module, i: int, x: torch.Tensor, step: Any) -> torch.Tensor:
        """Layer i's attention output for its normed input x."""
        raise NotImplementedError

    def fast_layers(self, h: torch.Tensor, step: Any) -> torch.Tensor | None:
        """The whole loop another way where it applies (else None: run_layers)."""
        return None

    def end(self, step: Any) -> None:
        """After the layers completed (a forward that raised skips it)."""

    def pack_lm_head(self) -> None:
        if self.lm_head_packed is None:  # else loaded packed (GGUF blocks)
            self.lm_head, self.lm_head_packed = pack_in_place(self.lm_head, prefill=False)

    def logits_of(self, residual: torch.Tensor, batch: ForwardBatch,
                  logits: bool) -> torch.Tensor | None:
        """Float32 logits [R, vocab] of batch.logit_rows from the last layer's residual stream;
        None when `logits` is False (TP ranks other than 0 leave sampling to rank 0). With
        batch.capture_hidden set, every row's final-norm output (what the lm_head reads: the
        hidden state an EAGLE draft head takes) goes to batch.hidden."""
        if batch.capture_hidden:
            batch.hidden = self.norm(residual)
        if not logits:
            return None
        h = self.norm(residual[batch.logit_rows])
        return linear(h, self.lm_head, None, self.lm_head_packed).float()

    def load_outer(self, sd: dict[str, torch.Tensor]) -> None:
        """The embedding (its mapped tensor serves as it is: the lookup reads a few rows a
        step), the lm_head (tied to the embedding when the checkpoint has none) and the final
        norm."""
        embed = sd["model.embed_tokens.weight"]
        lm = sd.get("lm_head.weight")
        if embed.dtype == torch.uint8 or (lm is not None and lm.dtype == torch.uint8):
            self._load_packed_outer(embed, lm)
        else:
            self.embed_tokens.weight = adopt(self.embed_tokens.weight, embed)
            self.lm_head.copy_(lm if lm is not None else embed)
        self.norm.weight.copy_(sd["model.norm.weight"])

    def _load_packed_outer(self, embed: torch.Tensor, lm: torch.Tensor | None) -> None:
        """GGUF blocks kept packed (gguf_packed.py): the embedding looks up de-quantized rows;
        the lm_head reads its own blocks, or the embedding's same tensor when tied."""
        def packed(t: torch.Tensor) -> torch.Tensor | None:
            return gguf_packed.for_gemm(gguf_packed.typed(t, getattr(t, gguf_packed.TYPE_ATTR))) \
                if t.dtype == torch.uint8 else None

        embed_packed = packed(embed)
        if embed_packed is not None:
            self.embed_tokens = gguf_packed.PackedEmbedding(embed_packed)
        else:
            self.embed_tokens.weight = adopt(self.embed_tokens.weight, embed)
        lm_packed = embed_packed if lm is None else packed(lm)
        if lm_packed is None:
            self.lm_head.copy_(lm if lm is not None else embed)
        else:
            self.lm_head = nn.Parameter(stand_in(self.lm_head), requires_grad=False)
            self.lm_head_packed = lm_packed
