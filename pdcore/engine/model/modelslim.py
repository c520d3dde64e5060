"""msModelSlim folders (`--quantization modelslim`, the seed's Ascend lines): the description
file `quant_model_description.json` names each tensor's scheme, and the weights load onto the
W8A8 int8 path (engine/model/quant.py).

Schemes run (docs/quantization.md):
- W8A8_DYNAMIC: `X.weight` int8 [out, in], `X.weight_scale` and `X.weight_offset` [out, 1]
  (offsets zero: symmetric); activations quantized per token at run time. Dense projections,
  MLA's q_a/q_b/kv_a/o (kv_b de-quantized at load: it is absorbed into the attention), the MoE
  experts (per expert) and the shared experts.
- W4A8_DYNAMIC, per output channel (the description's `group_size` 0 or absent), MoE experts
  (vllm-ascend's documented msModelSlim layout): `experts.E.{gate,up,down}_proj.weight` int8
  [out / 2, in], each byte two signed 4-bit weights of consecutive output rows (row 2r in the
  low nibble, 2r + 1 in the high one), `weight_scale` / `weight_offset` [out, 1] per unpacked
  row, and `scale_bias` (a term of the NPU kernel's int4 arithmetic, derived from the weights
  and scales; the CPU path has no use for it). The 4-bit values unpack into int8 ones in
  [-8, 7], so these experts run the same int8 x int8 GEMMs with per-token int8 activations:
  the W4A8 math exactly, at int8's memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from pdcore.engine.model.quant import SCALE_ATTR, Int8Checkpoint
from pdcore.errors import ConfigError

DESCRIPTION = "quant_model_description.json"
W4A8 = "W4A8_DYNAMIC"


def read_description(folder: str) -> dict:
    path = os.path.join(folder, DESCRIPTION)
    try:
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read msModelSlim's description ({e})") from None
    if not isinstance(desc, dict):
        raise ConfigError(f"{path}: not a JSON object of tensor names to schemes")
    return desc


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int8 [n / 2, k] holding two signed 4-bit values per byte (output row 2r in the low
    nibble, 2r + 1 in the high one) -> int8 [n, k] in [-8, 7]."""
    b = packed.to(torch.int16)
    low = ((b & 0x0F) ^ 0x08) - 0x08  # sign-extend each nibble
    high = (((b >> 4) & 0x0F) ^ 0x08) - 0x08
    return torch.stack((low, high), dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


class ModelSlimCheckpoint(Int8Checkpoint):
    """Int8Checkpoint over an msModelSlim folder's tensors: W4A8_DYNAMIC expert weights handed
    out unpacked to int8 (with their scales attached like every int8 weight); a W4A8 tensor
    anywhere else is refused (only the MoE experts' layout is documented)."""

    def __init__(self, sd: Mapping[str, torch.Tensor], desc: dict, where: str) -> None:
        super().__init__(sd)
        self.w4a8 = {k for k, v in desc.items() if v == W4A8 and k.endswith(".weight")}
        others = sorted(k for k in self.w4a8 if ".experts." not in k)
        if others:
            raise ConfigError(f"{where}: {others[0]} is W4A8_DYNAMIC; pdserve runs msModelSlim's "
                              "W4A8 for MoE experts only (the layout vllm-ascend documents), "
                              "W8A8_DYNAMIC elsewhere")

    def __getitem__(self, name: str) -> torch.Tensor:
        t = super().__getitem__(name)
        if name not in self.w4a8:
            return t
        scale = getattr(t, SCALE_ATTR)
        if t.shape[0] * 2 == scale.numel():  # packed: two rows a byte
            t = unpack_int4_rows(t)
        elif t.shape[0] != scale.numel():
            raise ConfigError(f"{name}: a W4A8 weight of {t.shape[0]} rows with "
                              f"{scale.numel()} scales (want one per row, or per two rows packed)")
        elif int(t.min()) < -8 or int(t.max()) > 7:
            raise ConfigError(f"{name}: a W4A8 weight holds values outside int4's [-8, 7]")
        setattr(t, SCALE_ATTR, scale)
        return t


def modelslim_checkpoint(sd: Mapping[str, torch.Tensor], folder: str,
                         where: str | None = None) -> ModelSlimCheckpoint:
    return ModelSlimCheckpoint(sd, read_description(folder), where or folder)
