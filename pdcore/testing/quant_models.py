"""Quantized checkpoints made at test and bench time from a float HF folder, with the tools the
ecosystem uses (no model hub here).

`make_w8a8_model`: the compressed-tensors W8A8 int8 layout (what llmcompressor's W8A8 recipe
saves and vLLM / SGLang load): every decoder linear's `weight` int8 [out, in] with a float32
`weight_scale` [out, 1] (symmetric, per output channel, computed and applied by
compressed-tensors' own qparams and quantize functions), activations quantized per token at run
time; the lm_head, embeddings and norms stay float. config.json gains compressed-tensors'
`quantization_config` (its W8A8 preset, format int-quantized).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

# the decoder projections a Llama-family checkpoint quantizes (llmcompressor's Linear targets,
# the lm_head ignored)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def w8a8_quantization_config(keep_float: tuple[str, ...] = ()) -> dict[str, Any]:
    """compressed-tensors' W8A8 preset as config.json's quantization_config; its `ignore` list
    names the lm_head and, as regular expressions (compressed-tensors' `re:` entries, what
    llmcompressor writes for a recipe's `ignore: ["re:.*down_proj"]`), the projections in
    `keep_float`."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    ignore = ["lm_head"] + [f"re:.*{p}$" for p in keep_float]
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                            ignore=ignore, format="int-quantized",
                            quantization_status="compressed")
    return json.loads(json.dumps(qc.model_dump(), default=str))


def _calibrate(model, calibration: list[list[int]], names: tuple[str, ...], fn) -> None:
    """fn(module path, input rows [T, K]) for each projection named in `names` over the
    `calibration` token id lists, run through the transformers `model`."""
    import torch

    hooks = []
    for path, mod in model.named_modules():
        if path.split(".")[-1] in names:
            hooks.append(mod.register_forward_pre_hook(
                lambda _m, a, path=path: fn(path, a[0].detach().reshape(-1, a[0].shape[-1]))))
    try:
        with torch.inference_mode():
            for ids in calibration:
                model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()


def smooth(model, calibration: list[list[int]], alpha: float = 0.8,
           alpha_down: float | None = None) -> None:
    """SmoothQuant (what llmcompressor's W8A8 recipe runs before quantizing, strength 0.8), in
    place on a transformers Llama-family `model`: each input channel j of q/k/v and of gate/up
    scaled by s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha) (x: the preceding norm's output
    over the `calibration` token ids) and that norm's weight divided by s_j; with `alpha_down`
    also down_proj's input channels, s_j moved out of up_proj's rows (silu(gate) * up is linear
    in up). The same float model, with the activations' outlier channels moved into the
    weights, which per-channel int8 holds better than per-token int8 holds the activations."""
    import torch

    amax: dict[str, torch.Tensor] = {}

    def record(path: str, x: torch.Tensor) -> None:
        a = x.abs().amax(0)
        amax[path] = a if path not in amax else torch.maximum(amax[path], a)

    _calibrate(model, calibration, ("q_proj", "gate_proj", "down_proj"), record)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            pre = f"model.layers.{i}."
            groups = [(pre + "self_attn.q_proj", alpha, layer.input_layernorm.weight,
                       (a.q_proj, a.k_proj, a.v_proj)),
                      (pre + "mlp.gate_proj", alpha, layer.post_attention_layernorm.weight,
                       (m.gate_proj, m.up_proj))]
            if alpha_down is not None:
                groups.append((pre + "mlp.down_proj", alpha_down, None, (m.down_proj,)))
            for key, strength, norm, lins in groups:
                wmax = torch.stack([lin.weight.abs().amax(0) for lin in lins]).amax(0)
                s = (amax[key].clamp(min=1e-5).pow(strength) /
                     wmax.clamp(min=1e-5).pow(1 - strength)).clamp(min=1e-5)
                if norm is None:
                    m.up_proj.weight.div_(s[:, None])
                else:
                    norm.div_(s)
                for lin in lins:
                    lin.weight.mul_(s)


def _state(model) -> dict[str, Any]:
    return {k: v.contiguous() for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}


def gptq_int8(w, hessian, scale, damp: float = 0.01, block: int = 128):
    """GPTQ (Frantar et al. 2022) for int8 per output channel with the channel scales fixed:
    the columns of w [N, K] quantized one at a time (in the order of the Hessian's diagonal,
    largest first), each one's rounding error spread over the columns not yet quantized through
    the inverse of H = X^T X / T (+ `damp` x its mean diagonal): the rounding that keeps
    x W^T closest over the calibration inputs X. Returns int8 [N, K]."""
    import torch

    s = scale.double().reshape(-1, 1).expand(w.shape)
    q = gptq(w, hessian, s, lambda v: torch.round(v).clamp(-128, 127), damp, block)
    return q.to(torch.int8)


def gptq(w, hessian, scale, rnd, damp: float = 0.01, block: int = 128):  # type: ignore[no-untyped-def]
    """GPTQ's column loop over w [N, K] with fixed element scales `scale` [N, K] and the grid's
    rounding `rnd` (values in units of the scale -> the nearest grid value, float): the grid
    values [N, K] (float64), W ~= result * scale. int8 (gptq_int8) and float8 e4m3 with block
    scales (make_fp8_model) differ only in `rnd` and `scale`."""
    import torch

    w = w.double().clone()
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True)
    w, h, s = w[:, perm], h[perm][:, perm], scale.double()[:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    k = w.shape[1]
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, e1, h1 = w[:, i1:i2].clone(), torch.zeros(w.shape[0], i2 - i1, dtype=w.dtype), \
            hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            qc = rnd(col / s[:, i1 + i]).double()
            q[:, i1 + i] = qc
            err = (col - qc * s[:, i1 + i]) / h1[i, i]
            w1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            e1[:, i] = err
        w[:, i2:] -= e1 @ hinv[i1:i2, i2:]
    return q[:, torch.argsort(perm)]


def _hessians(model, calibration: list[list[int]], names: tuple[str, ...]) -> dict:
    """H = X^T X / T of each projection named in `names` over the `calibration` inputs, by
    module path (GPTQ's statistics)."""
    hessians: dict = {}
    rows: dict[str, int] = {}

    def record(path: str, x) -> None:  # type: ignore[no-untyped-def]
        x = x.double()
        hessians[path] = hessians.get(path, 0) + x.t() @ x
        rows[path] = rows.get(path, 0) + x.shape[0]

    _calibrate(model, calibration, names, record)
    return {k: h / rows[k] for k, h in hessians.items()}


def make_w8a8_model(src: str, dst: str, calibration: list[list[int]] | None = None, *,
                    alpha_down: float | None = None, gptq: bool = False,
                    keep_float: tuple[str, ...] = ()) -> str:
    """`src` (a float HF folder, one safetensors file) quantized to compressed-tensors W8A8 int8
    in `dst`; returns `dst`. With `calibration` (token id lists) the weights are smoothed first
    (`smooth`, as llmcompressor's W8A8 recipe does; `alpha_down`: down_proj's inputs too) and,
    with `gptq`, rounded by GPTQ over the smoothed model's inputs to each projection (the
    recipe's second step) instead of to nearest. The projections named in `keep_float` (e.g.
    ("down_proj",)) stay float, listed in the config's `ignore` (as llmcompressor leaves a
    recipe's ignored layers). The format is the same either way."""
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    args = preset_name_to_scheme("W8A8", ["Linear"]).weights
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".safetensors") or name == "config.json":
            continue
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    out: dict[str, torch.Tensor] = {}
    hessians: dict[str, torch.Tensor] = {}
    if calibration:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        smooth(model, calibration, 0.8, alpha_down)
        tensors = _state(model)
        if gptq:
            hessians = _hessians(model, calibration,
                                 tuple(p for p in PROJECTIONS if p not in keep_float))
        del model
    else:
        tensors = {}
        for f in sorted(x for x in os.listdir(src) if x.endswith(".safetensors")):
            tensors.update(load_file(os.path.join(src, f)))
    for key, w in tensors.items():
        if key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS and \
                key.split(".")[-2] not in keep_float:
            w = w.float()
            scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                            args)
            h = hessians.get(key[: -len(".weight")])
            out[key] = gptq_int8(w, h, scale) if h is not None else \
                quantize(w, scale, zero, args, dtype=torch.int8)
            out[key[: -len("weight")] + "weight_scale"] = scale.float()
        else:
            out[key] = w.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = w8a8_quantization_config(keep_float)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    return dst


def fake_quant_rows(x):  # type: ignore[no-untyped-def]
    """x quantized per row as the W8A8 layers quantize their input (engine/model/quant.py:
    symmetric, max|x| / 127, round half to even, [-127, 127]) and de-quantized again: the float
    reference of the int8 math."""
    import torch

    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(xf / scale).clamp(-127, 127) * scale).to(x.dtype)


def w8a8_reference(w8a8: str, float_src: str,  # type: ignore[no-untyped-def]
                   int8_lm_head: bool = False, bf16_lm_head: bool = False,
                   bf16_input: bool = False):
    """transformers' model of `float_src`'s config with the W8A8 checkpoint's weights
    de-quantized (w_q * s_w, float32) and every quantized projection's input fake-quantized per
    token (`fake_quant_rows`): the same quantized math in float arithmetic, for greedy
    comparisons. `int8_lm_head`: the lm_head too, its weights quantized per output channel by
    compressed-tensors' qparams and quantize (what pdserve does at load with
    PDCORE_W8A8_LM_HEAD=int8, engine/model/quant.int8_lm_head), its input per token;
    `bf16_lm_head`: its weights rounded to bf16, its input float (PDCORE_W8A8_LM_HEAD=bf16);
    with `bf16_input` its input rounded to bf16 too (PDCORE_W8A8_LM_HEAD=bf16_dot)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(float_src)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = load_file(os.path.join(w8a8, "model.safetensors"))
    state = {}
    for key, t in sd.items():
        if key.endswith(".weight_scale"):
            continue
        if t.dtype == torch.int8:
            t = t.float() * sd[key[: -len("weight")] + "weight_scale"].float().reshape(-1, 1)
        state[key] = t
    missing, _ = model.load_state_dict(state, strict=False)
    assert all(k == "lm_head.weight" for k in missing), missing
    if "lm_head.weight" in missing:
        model.tie_weights()
    if int8_lm_head:
        from compressed_tensors.quantization import preset_name_to_scheme
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils import calculate_qparams

        args = preset_name_to_scheme("W8A8", ["Linear"]).weights
        w = model.lm_head.weight.detach().float()
        scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
        q = quantize(w, scale, zero, args, dtype=torch.int8)
        model.lm_head.weight = torch.nn.Parameter(q.float() * scale, requires_grad=False)
        model.lm_head.register_forward_pre_hook(lambda _m, args: (fake_quant_rows(args[0]),))
    elif bf16_lm_head:
        w = model.lm_head.weight.detach()
        model.lm_head.weight = torch.nn.Parameter(w.bfloat16().float(), requires_grad=False)
        if bf16_input:
            model.lm_head.register_forward_pre_hook(
                lambda _m, args: (args[0].bfloat16().to(args[0].dtype),))
    for name, mod in model.named_modules():  # the int8 layers' inputs (not `ignore`d ones)
        w = sd.get(name + ".weight")
        if isinstance(mod, torch.nn.Linear) and w is not None and w.dtype == torch.int8:
            mod.register_forward_pre_hook(lambda _m, args: (fake_quant_rows(args[0]),))
    return model


FP8_MAX = 448.0  # float8 e4m3's largest finite value


def fp8_target(key: str, t) -> bool:  # type: ignore[no-untyped-def]
    """Whether an FP8 checkpoint (DeepSeek-V3's) stores `key` in FP8: every decoder matrix --
    attention (MLA's kv_a/kv_b too), MLP, routed and shared experts, an MTP layer's eh_proj --
    but not the embedding, the lm_head (an MTP layer's own copies neither), the norms or the
    MoE router."""
    return (t.dim() == 2 and key.endswith(".weight") and ".layers." in key
            and "norm" not in key and not key.endswith("mlp.gate.weight")
            and "shared_expert_gate" not in key and "embed_tokens" not in key
            and "shared_head" not in key)


def fp8_block_quantize(w, block: tuple[int, int]):  # type: ignore[no-untyped-def]
    """(q float8_e4m3fn [N, K], scale float32 [ceil(N/bn), ceil(K/bk)]): each bn x bk block
    (the edge ones smaller) symmetric on its own absolute maximum, W ~= q * scale (DeepSeek-V3's
    `weight_scale_inv`, which multiplies)."""
    import torch

    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * bn, kb * bk)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.float()


def fp8_block_dequantize(q, scale, block: tuple[int, int]):  # type: ignore[no-untyped-def]
    n, k = q.shape
    s = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * s


def make_fp8_model(src: str, dst: str, block: tuple[int, int] = (128, 128),
                   calibration: list[list[int]] | None = None) -> str:
    """`src` (a float HF folder) in DeepSeek-V3's FP8 layout in `dst`: every `fp8_target`
    matrix float8 e4m3 with `weight_scale_inv` per `block`, config.json's quantization_config
    {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size}; MoE experts
    stay per expert (experts.{e}.gate_proj ...), as that checkpoint holds them. With
    `calibration` (token id lists; a Llama-family dense model) the block scales stay those of
    rounding to nearest and GPTQ picks each weight's e4m3 value over the inputs each
    projection sees (`gptq`: llmcompressor's GPTQ step with an FP8 scheme); else each weight
    rounds to its nearest e4m3 value."""
    import torch
    from safetensors.torch import load_file, save_file

    _copy_side_files(src, dst)
    hessians: dict = {}
    if calibration:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        hessians = _hessians(model, calibration, PROJECTIONS)
        del model
    out: dict[str, torch.Tensor] = {}
    for f in sorted(x for x in os.listdir(src) if x.endswith(".safetensors")):
        for key, w in load_file(os.path.join(src, f)).items():
            if not fp8_target(key, w):
                out[key] = w.contiguous()
                continue
            q, scale = fp8_block_quantize(w, block)
            h = hessians.get(key[: -len(".weight")])
            if h is not None:
                n, k = w.shape
                s = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
                q = gptq(w.float(), h, s, lambda v: v.float().clamp(-FP8_MAX, FP8_MAX).to(
                    torch.float8_e4m3fn).float()).float().to(torch.float8_e4m3fn)
            out[key], out[key[: -len("weight")] + "weight_scale_inv"] = q.contiguous(), scale
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    _write_config(src, dst, {"quant_method": "fp8", "fmt": "e4m3",
                             "activation_scheme": "dynamic", "weight_block_size": list(block)})
    return dst


def _copy_side_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".safetensors") or name == "config.json":
            continue
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def _write_config(src: str, dst: str, qc: dict[str, Any] | None) -> None:
    with open(os.path.join(src, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg.pop("quantization_config", None)
    if qc is not None:
        cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)


def fp8_dequantized_folder(fp8: str, dst: str) -> str:
    """The FP8 checkpoint `fp8` with every FP8 weight de-quantized (q * weight_scale_inv per
    block, float32) and its quantization_config dropped: the float model computing the same
    weights, for transformers to load as the reference."""
    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(fp8, "config.json"), encoding="utf-8") as fh:
        block = tuple(json.load(fh)["quantization_config"]["weight_block_size"])
    sd = load_file(os.path.join(fp8, "model.safetensors"))
    out = {}
    for key, t in sd.items():
        if key.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = fp8_block_dequantize(t, sd[key[: -len("weight")] + "weight_scale_inv"], block)
        out[key] = t.contiguous()
    _copy_side_files(fp8, dst)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    _write_config(fp8, dst, None)
    return dst


MODELSLIM_WEIGHTS = "quant_model_weight_w8a8_dynamic.safetensors"


def make_modelslim_w8a8_dynamic(w8a8: str, dst: str) -> str:
    """The compressed-tensors W8A8 folder `w8a8` (make_w8a8_model) rewritten in msModelSlim's
    W8A8_DYNAMIC layout (msmodelslim does not run on CPU; written to its documented format):
    `quant_model_weight_w8a8_dynamic.safetensors` with each quantized projection's `weight` int8,
    `weight_scale` [out, 1] and `weight_offset` [out, 1] (zeros: symmetric), the other tensors
    as they are; `quant_model_description.json` naming every tensor's scheme (W8A8_DYNAMIC or
    FLOAT) and model_quant_type; config.json without quantization_config."""
    import torch
    from safetensors.torch import load_file, save_file

    _copy_side_files(w8a8, dst)
    sd = load_file(os.path.join(w8a8, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    desc: dict[str, str] = {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0"}
    for key, t in sd.items():
        out[key] = t.contiguous()
        if key.endswith(".weight_scale"):
            base = key[: -len("weight_scale")]
            out[base + "weight_offset"] = torch.zeros_like(t, dtype=torch.float32)
            for name in ("weight", "weight_scale", "weight_offset"):
                desc[base + name] = "W8A8_DYNAMIC"
    for key in out:
        desc.setdefault(key, "FLOAT")
    save_file(out, os.path.join(dst, MODELSLIM_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(dst, "quant_model_description.json"), "w", encoding="utf-8") as fh:
        json.dump(desc, fh, indent=1)
    _write_config(w8a8, dst, None)
    return dst


def make_gguf_q8_0(src: str, dst: str) -> str:
    """The GGUF file `src` rewritten as a Q8_0 file at `dst` (llama.cpp's `--outtype q8_0`
    layout: every quantized matrix in Q8_0 blocks -- 32 weights, one float16 scale max|w| / 127
    -- the float tensors, norms, as they are; file_type MOSTLY_Q8_0), made with the `gguf`
    package's own quantize from `src`'s de-quantized weights (the float weights a Q4_1 file
    holds). The metadata (architecture, tokenizer, chat template) is copied; returns `dst`."""
    import gguf
    from gguf.quants import dequantize, quantize

    q8 = gguf.GGMLQuantizationType.Q8_0
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = gguf.LlamaFileType.MOSTLY_Q8_0
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    datas = []
    for t in reader.tensors:
        data = t.data
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, q8):
            data = quantize(dequantize(t.data, t.tensor_type), q8)
        kind = q8 if t.tensor_type != gguf.GGMLQuantizationType.F32 else t.tensor_type
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
        datas.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in datas:
        writer.write_tensor_data(data)
    writer.close()
    return dst
