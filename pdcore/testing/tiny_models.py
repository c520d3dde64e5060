"""Tiny random llama-family models built from transformers configs at test time."""

from __future__ import annotations

import os

import torch

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {}),  # + _DEEPSEEK below
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {}),
    # MoE: 8 experts of intermediate 32; Qwen2-MoE with a shared expert and a dense layer
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "head_dim": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}),
}
# MLA with yarn RoPE (as the real configs), 8 experts in 4 groups, layer 0 dense. V2 projects
# queries directly (as V2-Lite) and routes group-limited greedy; V3 has a query LoRA.
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
         "rope_theta": 10000.0}
_DEEPSEEK = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
             "n_routed_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
             "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "rope_parameters": _YARN}
_DEEPSEEK_ARCH = {
    "deepseek_v2": {"q_lora_rank": None, "n_shared_experts": 2,
                    "topk_method": "group_limited_greedy"},
    "deepseek_v3": {"q_lora_rank": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5},
}


def make_tiny_model(path: str, arch: str = "llama", vocab_size: int = 512, seed: int = 0,
                    hidden: int = 64, layers: int = 2, *, heads: int = 4, kv_heads: int = 2,
                    max_positions: int = 4096, tokenizer_from: str | None = None,
                    tie: bool = False) -> str:
    """Save a random model (config.json + safetensors) to `path`; returns `path`.

    tokenizer_from: a resolved-model folder/gguf whose tokenizer is saved alongside (its
    vocabulary size then sets the model's).
    """
    import transformers

    cfg_name, model_name, extra = ARCH_CONFIGS[arch]
    tok = None
    if tokenizer_from is not None:
        from pdcore.engine.model.gguf_cache import converted
        from pdcore.engine.model.tokenizer import resolve_model

        # a GGUF's tokenizer from its converted folder (what transformers read from the GGUF,
        # saved once): 0.3 s, not the 4 s of parsing the GGUF again for every tiny model
        r = converted(resolve_model(tokenizer_from))
        tok = transformers.AutoTokenizer.from_pretrained(r.path, **r.hf_kwargs())
        vocab_size = len(tok)
    if arch in _DEEPSEEK_ARCH:  # MLA: transformers expands K/V to every head, no GQA
        extra = {**_DEEPSEEK, **_DEEPSEEK_ARCH[arch]}
        kv_heads = heads
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(torch.float32).eval()
    with torch.no_grad():  # transformers zeroes V3's selection bias: make it matter
        for name, t in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


def add_mtp_layer(path: str, seed: int = 0, own_head: bool = False) -> str:
    """Give the tiny DeepSeek-V3 at `path` its MTP layer (what `--speculative-algorithm NEXTN`
    drafts with), which transformers does not create: random weights at index L =
    num_hidden_layers (`model.layers.{L}.` enorm, hnorm, eh_proj, a decoder layer: the last
    one's weights perturbed, so a MoE one from 2 layers up, as the MTP layer of a model whose
    first layer is dense is; shared_head.norm; `own_head`: also shared_head.head and
    embed_tokens of its own), and num_nextn_predict_layers 1 in config.json."""
    import json

    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    L, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    g = torch.Generator().manual_seed(seed)
    last, new = f"model.layers.{L - 1}.", f"model.layers.{L}."
    for k in [k for k in sd if k.startswith(last)]:
        t = sd[k]
        noise = torch.randn(t.shape, generator=g) * (0.05 if k.endswith("norm.weight") else 0.2)
        sd[new + k[len(last):]] = (t + noise).contiguous()
    sd[new + "enorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    sd[new + "hnorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    sd[new + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.15
    sd[new + "shared_head.norm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    if own_head:
        vocab = cfg["vocab_size"]
        sd[new + "shared_head.head.weight"] = torch.randn(vocab, hidden, generator=g) * 0.2
        sd[new + "embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g) * 0.2
    save_file(sd, f, metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2)
    return path


def make_eagle_head(path: str, *, vocab: int, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, seed: int = 0, own_embed: bool = False,
                    perfect: bool = False) -> str:
    """A random EAGLE-1 draft head folder (config.json + safetensors, SGLang's layout: fc on
    concat(embedding, hidden) with a bias, one Llama layer without its input norm) for a tiny
    target of that attention shape. `perfect`: fc passes the token embedding through and the
    layer adds nothing, so the head scores lm_head(embedding(token)), what a target whose
    layers add nothing predicts."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    p = "layers.0."
    sd = {"fc.weight": rnd(hidden, 2 * hidden), "fc.bias": rnd(hidden),
          p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
          p + "self_attn.k_proj.weight": rnd(kv_heads * hd, hidden),
          p + "self_attn.v_proj.weight": rnd(kv_heads * hd, hidden),
          p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
          p + "mlp.gate_proj.weight": rnd(2 * hidden, hidden),
          p + "mlp.up_proj.weight": rnd(2 * hidden, hidden),
          p + "mlp.down_proj.weight": rnd(hidden, 2 * hidden),
          p + "post_attention_layernorm.weight": 1 + rnd(hidden)}
    if perfect:
        sd["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        sd["fc.bias"] = torch.zeros(hidden)
        sd[p + "self_attn.o_proj.weight"] = torch.zeros(hidden, heads * hd)
        sd[p + "mlp.down_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    if own_embed:
        sd["embed_tokens.weight"] = rnd(vocab, hidden)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
           "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 1,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
           "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def make_eagle3_head(path: str, *, vocab: int, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, draft_vocab: int | None = None,
                     layer_ids: list[int] | None = None, seed: int = 0, fc_bias: bool = False,
                     agree_token: int | None = None) -> str:
    """A random EAGLE-3 draft head folder (engine/model/eagle3.py: SGLang's layout, `fc` over
    three target hidden states, `midlayer.*` with q/k/v over 2 * hidden, its own `norm` and
    `lm_head`) for a tiny target of that attention shape. `draft_vocab`: an lm_head over that
    many target ids (a random sorted subset) with `d2t` / `t2d`; None: no draft vocabulary
    (the target's lm_head scores). `layer_ids`: config eagle_config.eagle_aux_hidden_state_
    layer_ids (None: SGLang's default layers). `agree_token`: a head whose output is the same
    vector whatever it reads (fc's weight zero, its bias large on feature 0; o_proj and
    down_proj zero) and whose lm_head scores `agree_token` highest there (it must be in the
    draft vocabulary): it drafts that token always, what a target that always predicts it
    agrees with."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hd, inter = hidden // heads, 2 * hidden

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    p = "midlayer."
    sd = {"fc.weight": rnd(hidden, 3 * hidden),
          p + "self_attn.q_proj.weight": rnd(heads * hd, 2 * hidden),
          p + "self_attn.k_proj.weight": rnd(kv_heads * hd, 2 * hidden),
          p + "self_attn.v_proj.weight": rnd(kv_heads * hd, 2 * hidden),
          p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
          p + "mlp.gate_proj.weight": rnd(inter, hidden),
          p + "mlp.up_proj.weight": rnd(inter, hidden),
          p + "mlp.down_proj.weight": rnd(hidden, inter),
          "norm.weight": 1 + rnd(hidden) * 0.5}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        sd[p + n + ".weight"] = 1 + rnd(hidden) * 0.5
    if fc_bias or agree_token is not None:
        sd["fc.bias"] = rnd(hidden)
    hot = list(range(vocab))
    if draft_vocab is not None:
        rest = [t for t in torch.randperm(vocab, generator=g).tolist() if t != agree_token]
        hot = sorted(rest[: draft_vocab - (agree_token is not None)]
                     + ([agree_token] if agree_token is not None else []))
        sd["lm_head.weight"] = rnd(draft_vocab, hidden)
        sd["d2t"] = torch.tensor(hot) - torch.arange(draft_vocab)
        sd["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        sd["t2d"][hot] = True
    if agree_token is not None:
        assert draft_vocab is not None, "an agreeing head scores with its own lm_head"
        sd["fc.weight"] = torch.zeros(hidden, 3 * hidden)
        sd["fc.bias"] = torch.zeros(hidden)
        sd["fc.bias"][0] = 10.0
        sd[p + "self_attn.o_proj.weight"] = torch.zeros(hidden, heads * hd)
        sd[p + "mlp.down_proj.weight"] = torch.zeros(hidden, inter)
        sd["norm.weight"] = torch.ones(hidden)
        sd["lm_head.weight"][:, 0] = torch.rand(draft_vocab, generator=g) - 0.5
        sd["lm_head.weight"][hot.index(agree_token), 0] = 5.0
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "target_hidden_size": hidden,
           "bias": "fc.bias" in sd, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 2}
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids,
                               "use_aux_hidden_state": True}
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


def make_tiny_mimo(path: str, mtp_layers: int = 2, seed: int = 0, agree: bool = False,
                   **kw) -> str:
    """A tiny random MiMo (a Qwen2 body, config architectures ["MiMoForCausalLM"], model_type
    "mimo", num_nextn_predict_layers `mtp_layers`, an `auto_map` to remote code as the real
    checkpoint has) with its MTP layers `model.mtp_layers.{i}.` (token_layernorm,
    hidden_layernorm, input_proj, a Qwen2 decoder layer, final_layernorm), which transformers
    does not create. `agree`: a target whose layers add nothing (o_proj and down_proj zero: its
    next token is argmax lm_head(norm(embedding(token)))) and MTP layers that predict just that
    from their token: input_proj passes token_layernorm(embedding) through (the SECOND half of
    its input), the decoder layer adds nothing, final_layernorm has the final norm's weight."""
    import json

    from safetensors.torch import load_file, save_file

    make_tiny_model(path, arch="qwen2", seed=seed, **kw)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    g = torch.Generator().manual_seed(seed + 1000)
    last = f"model.layers.{L - 1}."
    for i in range(mtp_layers):
        p = f"model.mtp_layers.{i}."
        for k in [k for k in sd if k.startswith(last)]:  # the last layer's weights, perturbed
            t = sd[k]
            noise = torch.randn(t.shape, generator=g) * (0.05 if k.endswith("norm.weight")
                                                         else 0.2)
            sd[p + k[len(last):]] = (t + noise).contiguous()
        sd[p + "token_layernorm.weight"] = 1 + torch.randn(h, generator=g) * 0.1
        sd[p + "hidden_layernorm.weight"] = 1 + torch.randn(h, generator=g) * 0.1
        sd[p + "input_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.15
        sd[p + "final_layernorm.weight"] = 1 + torch.randn(h, generator=g) * 0.1
        if agree:
            sd[p + "input_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], 1)
            sd[p + "token_layernorm.weight"] = torch.ones(h)
            sd[p + "final_layernorm.weight"] = sd["model.norm.weight"].clone()
    if agree:
        for k in sd:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                sd[k] = torch.zeros_like(sd[k])
    save_file({k: v.contiguous() for k, v in sd.items()}, f, metadata={"format": "pt"})
    cfg.update(architectures=["MiMoForCausalLM"], model_type="mimo",
               num_nextn_predict_layers=mtp_layers,
               auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                         "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2)
    return path


def mimo_reference(path: str):
    """transformers' Qwen2ForCausalLM holding a tiny MiMo's body (its MTP weights left out):
    the reference for the target's greedy output."""
    import json

    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    for k in ("architectures", "model_type", "auto_map", "num_nextn_predict_layers"):
        raw.pop(k, None)
    model = Qwen2ForCausalLM(Qwen2Config(**raw)).to(torch.float32).eval()
    sd = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
          if not k.startswith("model.mtp_layers.")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model
