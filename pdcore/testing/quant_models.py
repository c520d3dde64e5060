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


def w8a8_quantization_config() -> dict[str, Any]:
    """compressed-tensors' W8A8 preset as config.json's quantization_config."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                            ignore=["lm_head"], format="int-quantized",
                            quantization_status="compressed")
    return json.loads(json.dumps(qc.model_dump(), default=str))


def make_w8a8_model(src: str, dst: str) -> str:
    """`src` (a float HF folder, one safetensors file) quantized to compressed-tensors W8A8 int8
    in `dst`; returns `dst`."""
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
    for f in sorted(x for x in os.listdir(src) if x.endswith(".safetensors")):
        for key, w in load_file(os.path.join(src, f)).items():
            if key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS:
                w = w.float()
                scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                                args)
                out[key] = quantize(w, scale, zero, args, dtype=torch.int8)
                out[key[: -len("weight")] + "weight_scale"] = scale.float()
            else:
                out[key] = w.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = w8a8_quantization_config()
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    return dst
