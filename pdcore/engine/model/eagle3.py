"""EAGLE-3 draft head (`--speculative-algorithm EAGLE3`) beside a target whose layers run
CausalLM.run_layers (every family here; tested with Llama).

What was checked (public sources, read for the facts only): SGLang's
python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3: its LlamaModel and decoder
layer, load_weights), its model_runner / eagle_worker (which target layers are captured, the
embedding and lm_head shared from the target) and the models' `set_eagle3_layers_to_capture`
(llama.py, qwen3.py: the same rule). vLLM's indexing (seen in code that converts between the
two, not in vLLM's own model files) captures at the same point, its top-level ids without + 1.

The checkpoint (an HF folder: config.json with architectures ["LlamaForCausalLMEagle3"],
model_type llama, num_hidden_layers 1; safetensors; names may carry a `model.` prefix):
- `fc.weight` [hidden, 3 * hidden] (a bias where config "bias" is true): projects the
  concatenation of the TARGET's hidden states taken at three layers to the layer's width;
- `midlayer.*`: one Llama decoder layer whose attention reads concat(input_layernorm(embedding
  of the token), hidden_norm(hidden)): `midlayer.self_attn.{q,k,v}_proj` take 2 * hidden
  inputs (no bias), `o_proj` gives hidden; `midlayer.hidden_norm`, `input_layernorm`,
  `post_attention_layernorm`, `mlp.{gate,up,down}_proj`;
- `norm.weight`: the head's own final norm; `lm_head.weight` [draft_vocab_size, hidden] over a
  draft vocabulary, with `d2t` [draft_vocab_size] (int): draft id d is target id d + d2t[d];
  `t2d` (a [vocab] mask of the target ids the draft vocabulary holds) is not read (as SGLang);
- config "draft_vocab_size" absent or null: the head scores with the target's lm_head (SGLang
  loads it from the target then); "tie_word_embeddings": with the (target's) embedding matrix;
- the embedding is always the target's (SGLang's set_embed; an `embed_tokens` in the folder is
  not read); the head's hidden size must be the target's (config "target_hidden_size", where
  given, too: a head of another width is not built).

Which target layers (SGLang): with config `eagle_config.eagle_aux_hidden_state_layer_ids` = ids
the residual stream ENTERING layer id + 1 (the output of layer id: hidden + residual, before
the next layer's input norm) for each id; without it the streams entering layers 2, L // 2 and
L - 3 (L: the target's layer count). A top-level `eagle_aux_hidden_state_layer_ids` (vLLM's
convention, no + 1) is not read. The three are concatenated in layer order. pdserve captures
them in CausalLM.run_layers (engine/model/base.py; index L: the stream after the last layer,
before the final norm); a step that captures runs the Python layer loop, not the native fused
decode loop (only EAGLE3 servers' steps capture). `eagle_config.use_aux_hidden_state` false is
not built.

The pass at position p with token t (the next token): x = fc(aux_p) when the hidden state fed
in is the target's (width 3 * hidden: observe, after every target forward), else x = the
hidden state as fed (width hidden: the head's own output, at later chain steps, NOT fc'd
again: SGLang decides by the width alike). Then
    r = x + attn(concat(input_layernorm(embed(t)), hidden_norm(x)))
    g = r + mlp(post_attention_layernorm(r))
g (before the norm) is what the chain feeds on; lm_head(norm(g)) scores the next token, over
the draft vocabulary mapped to target ids through d2t (`logits` returns target-vocabulary
logits, -inf off the draft vocabulary, so argmax gives TARGET ids). TP: the layer is sharded as
the target's layers (q/k/v by output heads: the 2 * hidden input is whole on every rank;
o_proj and down all-reduced); fc, the norms and lm_head are whole on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.engine.model.base import CausalLM
from pdcore.engine.model.batch import ForwardBatch
from pdcore.engine.model.eagle import LlamaLayerPool, TargetShared
from pdcore.engine.model.hf_config import read_plain_config
from pdcore.engine.model.layers import ColumnLinear, RMSNorm, linear
from pdcore.engine.model.llama import DecoderLayer
from pdcore.engine.model.rope import make_rotary
from pdcore.errors import ModelLoadError

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3",)
AUX_LAYERS = 3  # SGLang's fc reads three target hidden states


def aux_layers(cfg: Any, target_layers: int, where: str) -> tuple[int, ...]:
    """The target layers whose entering residual streams the head reads, ascending (see the
    module docstring)."""
    ec = getattr(cfg, "eagle_config", None) or {}
    if not isinstance(ec, dict):
        raise ModelLoadError(f"{where}: config.json's eagle_config is not an object")
    if not ec.get("use_aux_hidden_state", True):
        raise ModelLoadError(f"{where}: eagle_config.use_aux_hidden_state false (a head over "
                             "the target's last hidden state) is not built")
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    L = target_layers
    if ids is None:
        taps = [2, L // 2, L - 3]
    else:
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ModelLoadError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must "
                                 f"be a list of integers, not {ids!r}")
        taps = [i + 1 for i in ids]
    if len(taps) != AUX_LAYERS or len(set(taps)) != AUX_LAYERS or not all(
            0 <= i <= L for i in taps):
        rule = ("SGLang's default [2, L // 2, L - 3]" if ids is None
                else "eagle_config.eagle_aux_hidden_state_layer_ids + 1")
        raise ModelLoadError(
            f"{where}: the head reads the residual streams entering target layers {taps} "
            f"({rule}); they must be {AUX_LAYERS} distinct layers in [0, {L}] of the "
            f"{L}-layer target")
    return tuple(sorted(taps))


class Eagle3Head(TargetShared, LlamaLayerPool, nn.Module):
    name = "EAGLE3"

    def __init__(self, cfg: Any, target: CausalLM, taps: tuple[int, ...],
                 draft_vocab: int | None) -> None:
        super().__init__()
        h = self.hidden = cfg.hidden_size
        self.cfg, self.aux_layers = cfg, taps
        self.vocab = target.cfg.vocab_size
        self.fc = nn.Linear(len(taps) * h, h, bias=bool(getattr(cfg, "bias", False)))
        self.layer = DecoderLayer(cfg, target.tp, "llama")
        a = self.layer.self_attn  # q/k/v over concat(embedding, hidden): 2 * hidden inputs
        a.qkv = ColumnLinear(2 * h, a.qkv.parts, False, target.tp, shards=a.qkv.shards)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = make_rotary(cfg)
        self._target = (target,)  # embedding (always), lm_head (without a draft vocabulary)
        self.embed: nn.Embedding | None = None
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.own_head = (nn.Parameter(torch.empty(draft_vocab, h), requires_grad=False)
                         if draft_vocab is not None and not self.tied else None)
        self.hot: torch.Tensor | None = None  # draft id -> target id (d + d2t[d])
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """The head's outputs g [T, hidden] (before its norm) for the pairs (hidden[i],
        batch.input_ids[i]); hidden: the target's captured states [T, 3 * hidden] or the
        head's own outputs [T, hidden]. K/V go into k_cache / v_cache at batch.out_slots."""
        x = self.fc(hidden) if hidden.shape[-1] != self.hidden else hidden
        e = self.embed_tokens(batch.input_ids).to(x.dtype)
        cos, sin = self.rotary(x.unsqueeze(0), batch.positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1).to(x.dtype), sin[0].unsqueeze(1).to(x.dtype)
        layer = self.layer
        z = torch.cat([layer.input_layernorm(e), self.hidden_norm(x)], dim=-1)
        residual = x + layer.self_attn(z, cos, sin, k_cache, v_cache, batch)
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, target vocab] of the outputs h [R, hidden]: the draft
        vocabulary's scores at their target ids, -inf at the others."""
        x = self.norm(h)
        t = self._target[0]
        if self.tied:
            return F.linear(x, t.embed_tokens.weight.to(x.dtype)).float()
        if self.own_head is None:
            return linear(x, t.lm_head, None, t.lm_head_packed).float()
        d = F.linear(x, self.own_head).float()
        if self.hot is None:
            return d
        out = d.new_full((d.shape[0], self.vocab), float("-inf"))
        out[:, self.hot] = d
        return out

    @torch.inference_mode()
    def load(self, sd, where: str) -> None:
        def get(name: str) -> torch.Tensor | None:
            for key in (name, "model." + name):
                if key in sd:
                    return sd[key]
            return None

        def need(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = get(name)
            if t is None:
                raise ModelLoadError(f"{where}: the EAGLE3 draft head lacks the weight {name!r}")
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"{where}: the EAGLE3 weight {name!r} has shape "
                                     f"{tuple(t.shape)}, expected {shape} (from config.json "
                                     "and the target)")
            return t

        cfg, h = self.cfg, self.hidden
        self.fc.weight.copy_(need("fc.weight", (h, self.fc.in_features)))
        if self.fc.bias is not None:
            self.fc.bias.copy_(need("fc.bias", (h,)))
        p = "midlayer."
        a = self.layer.self_attn
        hd, nq, nkv = a.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        a.qkv.load([need(p + "self_attn.q_proj.weight", (nq * hd, 2 * h)),
                    need(p + "self_attn.k_proj.weight", (nkv * hd, 2 * h)),
                    need(p + "self_attn.v_proj.weight", (nkv * hd, 2 * h))])
        a.o_proj.load(need(p + "self_attn.o_proj.weight", (h, nq * hd)))
        inter = cfg.intermediate_size
        m = self.layer.mlp
        m.gate_up.load([need(p + "mlp.gate_proj.weight", (inter, h)),
                        need(p + "mlp.up_proj.weight", (inter, h))])
        m.down.load(need(p + "mlp.down_proj.weight", (h, inter)))
        for norm, name in ((self.layer.input_layernorm, p + "input_layernorm.weight"),
                           (self.hidden_norm, p + "hidden_norm.weight"),
                           (self.layer.post_attention_layernorm,
                            p + "post_attention_layernorm.weight"),
                           (self.norm, "norm.weight")):
            norm.weight.copy_(need(name, (h,)))
        if self.own_head is None:
            return
        dv = self.own_head.shape[0]
        self.own_head.copy_(need("lm_head.weight", (dv, h)))
        d2t = get("d2t")
        if d2t is None:
            if dv != self.vocab:
                raise ModelLoadError(f"{where}: a draft vocabulary of {dv} ids (< the "
                                     f"target's {self.vocab}) needs the d2t map")
            return
        if tuple(d2t.shape) != (dv,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ModelLoadError(f"{where}: d2t must be [{dv}] integers (draft id -> target "
                                 f"id offset), not {d2t.dtype} {tuple(d2t.shape)}")
        hot = d2t.to(torch.long) + torch.arange(dv)
        if int(hot.min()) < 0 or int(hot.max()) >= self.vocab or hot.unique().numel() != dv:
            raise ModelLoadError(f"{where}: d2t maps draft ids outside the target's vocabulary "
                                 f"of {self.vocab} or two onto one target id")
        self.hot = hot


def load_eagle3_head(path: str, target: CausalLM, dtype: torch.dtype,
                     device: torch.device) -> Eagle3Head:
    """The EAGLE3 head of the folder `path` beside `target` (checked against it)."""
    from pdcore.engine.model.fp8 import quantized_weights
    from pdcore.engine.model.weights import SafetensorsWeights

    where = f"--speculative-draft-model-path {path}"
    cfg = read_plain_config(path, EAGLE3_ARCHS)
    if cfg is None:
        raise ModelLoadError(f"{where}: expected an HF folder whose config.json names "
                             f"{list(EAGLE3_ARCHS)} (model_type llama)")
    tcfg = target.cfg
    if cfg.num_hidden_layers != 1:
        raise ModelLoadError(f"{where}: the EAGLE3 head has {cfg.num_hidden_layers} layers; "
                             "only one-layer heads (`midlayer`) are built")
    th = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
    if cfg.hidden_size != tcfg.hidden_size or th != tcfg.hidden_size:
        raise ModelLoadError(f"{where}: the EAGLE3 head's hidden size {cfg.hidden_size} (target "
                             f"hidden size {th}) differs from the target's {tcfg.hidden_size}; "
                             "heads of another width are not built")
    if cfg.vocab_size != tcfg.vocab_size:
        raise ModelLoadError(f"{where}: the EAGLE3 head's vocab_size {cfg.vocab_size} differs "
                             f"from the target's {tcfg.vocab_size}")
    dv = getattr(cfg, "draft_vocab_size", None)
    if dv is not None and not 0 < int(dv) <= tcfg.vocab_size:
        raise ModelLoadError(f"{where}: draft_vocab_size {dv} must be in [1, "
                             f"{tcfg.vocab_size}] (the target's vocabulary)")
    if getattr(cfg, "tie_word_embeddings", False) and dv not in (None, tcfg.vocab_size):
        raise ModelLoadError(f"{where}: tie_word_embeddings with a draft vocabulary of {dv} "
                             "ids: a tied head scores the whole vocabulary")
    if not hasattr(target, "layers"):
        raise ModelLoadError(f"{where}: the target model has no layer list to capture from")
    taps = aux_layers(cfg, len(target.layers), where)
    head = Eagle3Head(cfg, target, taps, None if dv is None else int(dv))
    head.load(quantized_weights(SafetensorsWeights(path), path), where)
    with torch.inference_mode():
        head = head.to(device=device, dtype=dtype).eval()
        if head.hot is not None:
            head.hot = head.hot.to(device)
    return head
