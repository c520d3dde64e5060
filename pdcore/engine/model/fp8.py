"""FP8 weights (`--quantization fp8`): float8 e4m3 (or e5m2) weights with per-tensor, per-channel
or block scales, kept 8-bit in memory and de-quantized one layer at a time when it computes.

Layouts read (engine/model/quant_config.py detects them from config.json):
- `quant_method: fp8` (DeepSeek-V3/R1, Qwen3-FP8): `X.weight` float8 [N, K] with
  `X.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] for `weight_block_size: [bn, bk]`
  (128x128 in DeepSeek-V3), or one value per tensor; W ~= weight * weight_scale_inv per block
  (despite its name the stored value multiplies);
- compressed-tensors float8: `X.weight_scale` per tensor ([1]), per channel ([N, 1]) or per
  block.

Every scale layout is held the same way: one float32 scale per (row, K-block), `[N, ceil(K/bk)]`
(bk = K for per-tensor and per-channel scales), 1/32 byte per weight at bk 128; so the row
slices TP and fused q/k/v or gate/up take are row slices of the scales too, whatever the block
height. At compute a layer's weight is de-quantized into the activations' dtype (one temporary
matrix, freed after the GEMM) and the GEMM runs in that dtype: weight-only quantization,
activations stay float (the math a de-quantized float checkpoint computes, to the rounding).

`Fp8Checkpoint` wraps the checkpoint's mapping: each FP8 weight is handed out de-quantized to
float32 (so a layer that takes float weights only -- MLA's absorbed kv_b, the shared experts'
down projection -- loads the right values) with its `Fp8Weight` attached (`FP8_ATTR`); the
linear layers (layers.py) and the MoE experts (moe.py) keep the attached FP8 weight instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdcore.engine.model.quant import CheckpointView

FP8_ATTR = "pd_fp8_weight"  # set on a de-quantized weight handed out by Fp8Checkpoint
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_NAMES = ("weight_scale_inv", "weight_scale")


class Fp8Weight:
    """One weight [N, K] in FP8 with its scales per (row, K-block) `[N, ceil(K/bk)]`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bk: int) -> None:
        if q.dtype not in FP8_DTYPES or q.dim() != 2:
            raise ValueError(f"an FP8 weight must be a float8 matrix, got {q.dtype} "
                             f"{tuple(q.shape)}")
        nb = -(-q.shape[1] // bk)
        if scale.shape != (q.shape[0], nb):
            raise ValueError(f"FP8 scales {tuple(scale.shape)} for a weight {tuple(q.shape)} in "
                             f"K-blocks of {bk}: want {(q.shape[0], nb)}")
        self.q, self.scale, self.bk = q, scale.float(), bk

    @classmethod
    def from_checkpoint(cls, q: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int] | None) -> Fp8Weight:
        """From the checkpoint's weight and scale tensors: a single value (per tensor), one per
        row ([N] or [N, 1]), or blocks ([ceil(N/bn), ceil(K/bk)] for `block` = (bn, bk))."""
        n, k = q.shape
        s = scale.detach().float()
        if s.numel() == 1:
            rows, bk = s.reshape(1, 1).expand(n, 1), k
        elif s.numel() == n and (s.dim() == 1 or s.shape[-1] == 1):
            rows, bk = s.reshape(n, 1), k
        elif s.dim() == 2 and block is not None and s.shape == (-(-n // block[0]),
                                                                -(-k // block[1])):
            rows, bk = s.repeat_interleave(block[0], 0)[:n], block[1]
        else:
            raise ValueError(f"FP8 scale of shape {tuple(s.shape)} for a weight {(n, k)}: not per "
                             f"tensor, per channel or in blocks of {block}")
        return cls(q.contiguous().clone(), rows.contiguous().clone(), bk)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, first: int, n: int) -> Fp8Weight:
        return Fp8Weight(self.q[first : first + n], self.scale[first : first + n], self.bk)

    def cols(self, first: int, n: int) -> Fp8Weight:
        """Input features first..first+n (a TP shard of a row-parallel layer): whole K-blocks
        only, or a per-row scale."""
        if self.scale.shape[1] == 1:
            return Fp8Weight(self.q[:, first : first + n], self.scale, n)
        if first % self.bk or (n % self.bk and first + n != self.q.shape[1]):
            raise ValueError(f"an FP8 shard of input features {first}..{first + n} cuts the "
                             f"weight's K-blocks of {self.bk}")
        b0 = first // self.bk
        return Fp8Weight(self.q[:, first : first + n],
                         self.scale[:, b0 : b0 + -(-n // self.bk)], self.bk)

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        if len({(p.bk, p.scale.shape[1]) for p in parts}) != 1:
            raise ValueError("fused FP8 weights with different K-blocks")
        if len(parts) == 1:
            p = parts[0]  # owned copies: a TP shard does not keep the whole weight alive
            return Fp8Weight(p.q.clone(memory_format=torch.contiguous_format),
                             p.scale.clone(memory_format=torch.contiguous_format), p.bk)
        return Fp8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                         parts[0].bk)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W = q * scale per (row, K-block), in `dtype` [N, K]."""
        n, k = self.q.shape
        w = self.q.to(torch.float32)
        if k % self.bk == 0:
            w.view(n, -1, self.bk).mul_(self.scale.unsqueeze(-1))
        else:
            w.mul_(self.scale.repeat_interleave(self.bk, 1)[:, :k])
        return w if dtype == torch.float32 else w.to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized(x.dtype), bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


def fp8_of(weight: torch.Tensor) -> Fp8Weight | None:
    """The FP8 weight Fp8Checkpoint attached to a de-quantized weight, if any."""
    return getattr(weight, FP8_ATTR, None)


class Fp8Experts:
    """A MoE layer's local experts in FP8: gate+up [E, 2I, H] and down [E, H, I], each expert's
    weights with their scales per (row, K-block); de-quantized together when the layer runs."""

    def __init__(self, w13: list[Fp8Weight], w2: list[Fp8Weight]) -> None:
        self.w13, self.w2 = w13, w2

    @classmethod
    def load(cls, gate: list[Fp8Weight], up: list[Fp8Weight], down: list[Fp8Weight],
             first: int, n: int) -> Fp8Experts:
        """Experts from per-expert gate/up/down weights, intermediate features first..first+n
        (a TP share)."""
        w13 = [Fp8Weight.cat([g.rows(first, n), u.rows(first, n)]) for g, u in zip(gate, up)]
        w2 = [Fp8Weight.cat([d.cols(first, n)]) for d in down]
        return cls(w13, w2)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([w.dequantized(dtype) for w in self.w13]),
                torch.stack([w.dequantized(dtype) for w in self.w2]))

    def tensors(self) -> list[torch.Tensor]:
        return [t for w in (*self.w13, *self.w2) for t in w.tensors()]


def fp8_experts(sd: Mapping[str, torch.Tensor], prefix: str, first_expert: int, n: int,
                inter_first: int, inter: int) -> Fp8Experts | None:
    """The experts first_expert..+n of the MoE block at `prefix` kept FP8, where the checkpoint
    holds them per expert in FP8 (DeepSeek-V3's layout); None otherwise."""
    p0 = prefix + f"experts.{first_expert}."
    if p0 + "gate_proj.weight" not in sd or fp8_of(sd[p0 + "gate_proj.weight"]) is None:
        return None
    parts: dict[str, list[Fp8Weight]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for e in range(first_expert, first_expert + n):
        for name, out in parts.items():
            w = fp8_of(sd[prefix + f"experts.{e}.{name}.weight"])
            if w is None:
                return None
            out.append(w)
    return Fp8Experts.load(parts["gate_proj"], parts["up_proj"], parts["down_proj"],
                           inter_first, inter)


class Fp8Checkpoint(CheckpointView):
    """The checkpoint's tensors by name, each FP8 `X.weight` handed out de-quantized (float32)
    with its Fp8Weight attached; everything else as the wrapped mapping has it. `block`: the
    config's weight_block_size (bn, bk), if any."""

    def __init__(self, sd: Mapping[str, torch.Tensor], block: tuple[int, int] | None) -> None:
        super().__init__(sd)
        self.block = block
        self.fp8_handed_out = 0  # FP8 weights given to the model (logs)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.sd[name]
        if t.dtype in FP8_DTYPES and name.endswith(".weight"):
            base = name[: -len("weight")]
            scale = next((base + s for s in SCALE_NAMES if base + s in self.sd), None)
            if scale is None:
                raise KeyError(base + SCALE_NAMES[0])
            if t.dim() != 2:
                raise ValueError(f"{name}: an FP8 weight of {t.dim()} dimensions (matrices "
                                 "only)")
            w = Fp8Weight.from_checkpoint(t, self.sd[scale], self.block)
            out = w.dequantized()
            setattr(out, FP8_ATTR, w)
            self.fp8_handed_out += 1
            return out
        return t

def fp8_layers(model: torch.nn.Module) -> tuple[int, int]:
    """(linear layers, MoE expert sets) of `model` that hold FP8 weights."""
    lin = sum(getattr(m, "fp8", None) is not None and isinstance(m.fp8, Fp8Weight)
              for m in model.modules())
    moe = sum(isinstance(getattr(m, "fp8", None), Fp8Experts) for m in model.modules())
    return lin, moe


def block_of(folder: str) -> tuple[int, int] | None:
    """config.json's FP8 weight_block_size (bn, bk) in `folder` (compressed-tensors: its
    weights' block_structure), if any."""
    import json
    import os

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            qc = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    block = qc.get("weight_block_size")
    if block is None:
        block = next((g.get("weights", {}).get("block_structure")
                      for g in (qc.get("config_groups") or {}).values()
                      if g.get("weights", {}).get("block_structure")), None)
    if block is None:
        return None
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise ValueError(f"quantization_config weight_block_size {block}: want [rows, cols]")
    return int(block[0]), int(block[1])


def quantized_weights(sd: Mapping[str, torch.Tensor], folder: str
                      ) -> Mapping[str, torch.Tensor]:
    """A draft head's checkpoint mapping read as the target's is (the same detection,
    quant_config.detect): FP8 and W8A8 weights handed out with their scales, so the head's
    linear layers keep them quantized and no quantized tensor is read as float values."""
    from pdcore.engine.model import quant_config
    from pdcore.engine.model.quant import Int8Checkpoint

    name = quant_config.detect(folder, None).name
    if name == "fp8":
        return Fp8Checkpoint(sd, block_of(folder))
    if name == "modelslim":
        from pdcore.engine.model.modelslim import modelslim_checkpoint

        return modelslim_checkpoint(sd, folder)
    if name == "w8a8_int8":
        return Int8Checkpoint(sd)
    return sd
