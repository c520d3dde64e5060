"""msModelSlim DeepSeek checkpoints made at test time from a float DeepSeek folder (msmodelslim
does not run on CPU: written to its documented layout, engine/model/modelslim.py), the float
folder of the weights they compute with, and transformers' reference of their int8 math."""

from __future__ import annotations

import json
import os
from typing import Any

from pdcore.testing.quant_models import (
    _copy_side_files, _write_config, fake_quant_rows, fp8_target)

# the MLA / MLP projections a DeepSeek reference fake-quantizes the input of (kv_b_proj runs
# weight-only: the engine absorbs it into the attention de-quantized)
DEEPSEEK_ACT_QUANT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj",
                      "up_proj", "down_proj")


def _int_per_channel(w, qmax: int):  # type: ignore[no-untyped-def]
    """(q int8 [N, K] in [-qmax - 1, qmax], scale float32 [N, 1]): symmetric per output row."""
    import torch

    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.round(wf / scale).clamp(-qmax - 1, qmax).to(torch.int8), scale


def pack_int4_rows(q):  # type: ignore[no-untyped-def]
    """int8 [N, K] in [-8, 7] (N even) -> [N / 2, K]: row 2r in each byte's low nibble, 2r + 1
    in its high one (msModelSlim's W4A8 experts, as vllm-ascend describes them)."""
    import torch

    low, high = q[0::2].to(torch.int16) & 0x0F, q[1::2].to(torch.int16) & 0x0F
    b = low | (high << 4)
    return torch.where(b > 127, b - 256, b).to(torch.int8)


def static_input_ranges(src: str, calibration: list[list[int]]) -> dict[str, Any]:
    """{linear module path: (input_scale, input_offset)} for each nn.Linear transformers' model
    of `src` runs outside the routed experts, asymmetric over the `calibration` token ids'
    inputs: x_q = round(x / scale + offset) spans [-128, 127] (0 exactly representable)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    seen: dict[str, list[float]] = {}

    def record(path: str, x) -> None:  # type: ignore[no-untyped-def]
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        old = seen.get(path, [0.0, 0.0])
        seen[path] = [min(old[0], lo), max(old[1], hi)]

    hooks = [m.register_forward_pre_hook(lambda _m, a, path=path: record(path, a[0]))
             for path, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and ".layers." in path]
    with torch.inference_mode():
        for ids in calibration:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    out = {}
    for path, (lo, hi) in seen.items():
        scale = max(hi - lo, 1e-6) / 255
        out[path] = (scale, float(round(-lo / scale) - 128))
    return out


def make_modelslim_deepseek(src: str, dst: str, w4a8: bool = False,
                            static: dict[str, Any] | None = None) -> str:
    """The float DeepSeek folder `src` quantized into msModelSlim's layout in `dst` (msmodelslim
    does not run on CPU; written to its documented format): every decoder matrix `fp8_target`
    names (MLA's q_a/q_b/kv_a/kv_b/o, dense MLPs, routed and shared experts, the MTP layer's)
    W8A8_DYNAMIC -- int8 per output channel, `weight_scale` / `weight_offset` [out, 1], offsets
    zero -- or, with `w4a8`, the routed experts W4A8_DYNAMIC per channel: 4-bit values packed
    two output rows a byte, with `scale_bias` (the NPU kernel's 8 * sum_k q * s term; [out, 1],
    down_proj's in 16 K-slices [out, 16]); the description file names every tensor's scheme,
    model_quant_type and group_size 0. `static` ({module path: (input_scale, input_offset)},
    static_input_ranges): those modules static W8A8 instead -- `weight` int8 per channel,
    `input_scale` / `input_offset` [1], `deq_scale` float32 [out] (input_scale x the weight's
    scale) and `quant_bias` int32 [out] (-input_offset x the row's sum of weights)."""
    import torch
    from safetensors.torch import load_file, save_file

    _copy_side_files(src, dst)
    kind = "W4A8_DYNAMIC" if w4a8 else "W8A8_DYNAMIC"
    desc: dict[str, Any] = {"model_quant_type": kind, "version": "1.0.0"}
    if w4a8:
        desc["group_size"] = 0
    out: dict[str, torch.Tensor] = {}
    for f in sorted(x for x in os.listdir(src) if x.endswith(".safetensors")):
        for key, w in load_file(os.path.join(src, f)).items():
            if not fp8_target(key, w):
                out[key], desc[key] = w.contiguous(), "FLOAT"
                continue
            base = key[: -len("weight")]
            scheme = "W4A8_DYNAMIC" if w4a8 and ".experts." in key else "W8A8_DYNAMIC"
            q, scale = _int_per_channel(w, 7 if scheme == "W4A8_DYNAMIC" else 127)
            if static is not None and base[:-1] in static:
                s_x, off = static[base[:-1]]
                out[key] = q.contiguous()
                out[base + "input_scale"] = torch.tensor([s_x])
                out[base + "input_offset"] = torch.tensor([off])
                out[base + "deq_scale"] = (scale.reshape(-1) * s_x).float()
                out[base + "quant_bias"] = (-off * q.long().sum(1)).to(torch.int32)
                for name in ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"):
                    desc[base + name] = "W8A8"
                continue
            out[base + "weight_scale"] = scale
            out[base + "weight_offset"] = torch.zeros_like(scale)
            if scheme == "W4A8_DYNAMIC":
                term = 8 * q.float() * scale
                out[base + "scale_bias"] = (
                    term.view(q.shape[0], 16, -1).sum(-1) if key.endswith("down_proj.weight")
                    else term.sum(1, keepdim=True))
                q = pack_int4_rows(q)
            out[key] = q.contiguous()
            for name in ("weight", "weight_scale", "weight_offset", "scale_bias"):
                if base + name in out:
                    desc[base + name] = scheme
    name = f"quant_model_weight_{kind.lower()}.safetensors"
    save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
    with open(os.path.join(dst, "quant_model_description.json"), "w", encoding="utf-8") as fh:
        json.dump(desc, fh, indent=1)
    _write_config(src, dst, None)
    return dst


def modelslim_dequantized_folder(ms: str, dst: str) -> str:
    """The msModelSlim folder `ms` with every int8 weight de-quantized (4-bit ones unpacked
    first; q * weight_scale, float32) and the quantization tensors dropped: the float weights
    its int8 layers compute with, for transformers to load."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdcore.engine.model.modelslim import unpack_int4_rows

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(x for x in os.listdir(ms) if x.endswith(".safetensors")):
        sd.update(load_file(os.path.join(ms, f)))
    out = {}
    for key, t in sd.items():
        if key.endswith((".weight_scale", ".weight_offset", ".scale_bias", ".input_scale",
                         ".input_offset", ".deq_scale", ".quant_bias")):
            continue
        base = key[: -len("weight")]
        if t.dtype == torch.int8 and base + "deq_scale" in sd:  # static: s_w = deq / s_x
            t = t.float() * (sd[base + "deq_scale"].float() / sd[base + "input_scale"].float()
                             ).reshape(-1, 1)
        elif t.dtype == torch.int8:
            scale = sd[key[: -len("weight")] + "weight_scale"].float()
            if t.shape[0] * 2 == scale.numel():
                t = unpack_int4_rows(t)
            t = t.float() * scale.reshape(-1, 1)
        out[key] = t.contiguous()
    _copy_side_files(ms, dst)
    os.remove(os.path.join(dst, "quant_model_description.json"))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    _write_config(ms, dst, None)
    return dst


def fake_quant_static(x, scale: float, offset: float):  # type: ignore[no-untyped-def]
    """x through a static W8A8 layer's activation quantization and back:
    (clamp(round(x / scale + offset), -128, 127) - offset) * scale."""
    import torch

    q = torch.round(x.float() / scale + offset).clamp(-128, 127)
    return ((q - offset) * scale).to(x.dtype)


def deepseek_int8_reference(dequantized: str, static: dict[str, Any] | None = None
                            ):  # type: ignore[no-untyped-def]
    """transformers' DeepSeek on the de-quantized folder with the engine's int8 math in float:
    the input of every DEEPSEEK_ACT_QUANT projection and of each routed expert's gate_up and
    down fake-quantized per token (fake_quant_rows), or, for the modules in `static` (as
    make_modelslim_deepseek took it), with their static scale and offset (not kv_b_proj's: the
    engine de-quantizes it at load, weight-only)."""
    import types

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    for name, mod in model.named_modules():
        if static is not None and name in static and not name.endswith("kv_b_proj"):
            mod.register_forward_pre_hook(
                lambda _m, args, sx=static[name]: (fake_quant_static(args[0], *sx),))
        elif isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in DEEPSEEK_ACT_QUANT:
            mod.register_forward_pre_hook(lambda _m, args: (fake_quant_rows(args[0]),))
        if hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj"):
            mod.forward = types.MethodType(_fake_quant_experts, mod)
    return model


def _fake_quant_experts(self, hidden_states, top_k_index, top_k_weights):  # type: ignore
    """A routed-experts forward for transformers' fused expert tensors ([E, 2I, H], [E, H, I]):
    each token through each chosen expert, its two GEMM inputs fake-quantized per token."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(hidden_states)
    for e in range(self.gate_up_proj.shape[0]):
        tok, pos = torch.where(top_k_index == e)
        if len(tok) == 0:
            continue
        gate, up = F.linear(fake_quant_rows(hidden_states[tok]), self.gate_up_proj[e]).chunk(2, -1)
        y = F.linear(fake_quant_rows(self.act_fn(gate) * up), self.down_proj[e])
        out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
    return out
