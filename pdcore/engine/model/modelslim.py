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
- W8A8 (static), linear layers (msModelSlim's documented weight format): `weight` int8,
  `input_scale` / `input_offset` per tensor, `deq_scale` and `quant_bias` per output channel
  (StaticInt8Weight).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from pdcore.engine.model.quant import SCALE_ATTR, Int8Checkpoint, scale_of
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


def as_float(weight: torch.Tensor) -> torch.Tensor:
    """A weight a layer keeps in float (MLA's absorbed kv_b_proj, an MTP layer's eh_proj): an
    int8 weight the checkpoint view handed out de-quantized (w_q * s_w per output channel; a
    static W8A8 one's s_w is deq_scale / input_scale), float32; any other tensor as it is."""
    if weight.dtype != torch.int8:
        return weight
    static = static_of(weight)
    scale = scale_of(weight) if static is None else static[2].reshape(-1) / static[0]
    return weight.float() * scale.float()[:, None]


class ModelSlimCheckpoint(Int8Checkpoint):
    """Int8Checkpoint over an msModelSlim folder's tensors: W4A8_DYNAMIC expert weights handed
    out unpacked to int8 (with their scales attached like every int8 weight), static W8A8 ones
    with their activation scale, offset, deq_scale and quant_bias attached (STATIC_ATTR); W4A8
    outside the MoE experts (only the experts' layout is documented) and static W8A8 experts
    (the NPU runs its MoE dynamic) are refused."""

    def __init__(self, sd: Mapping[str, torch.Tensor], desc: dict, where: str) -> None:
        super().__init__(sd)
        self.where = where
        self.w4a8 = {k for k, v in desc.items() if v == W4A8 and k.endswith(".weight")}
        self.static = {k for k, v in desc.items() if v == STATIC and k.endswith(".weight")}
        others = sorted(k for k in self.w4a8 if ".experts." not in k)
        if others:
            raise ConfigError(f"{where}: {others[0]} is W4A8_DYNAMIC; pdserve runs msModelSlim's "
                              "W4A8 for MoE experts only (the layout vllm-ascend documents), "
                              "W8A8_DYNAMIC elsewhere")
        experts = sorted(k for k in self.static if ".experts." in k)
        if experts:
            raise ConfigError(f"{where}: {experts[0]} is static W8A8; MoE experts run "
                              "W8A8_DYNAMIC or W4A8_DYNAMIC (static W8A8 is for linear layers)")

    def int8_weight_names(self) -> set[str]:
        return super().int8_weight_names() | self.static

    def _static(self, name: str) -> torch.Tensor:
        base = name[: -len("weight")]
        missing = [n for n in STATIC_NAMES if base + n not in self.sd]
        if missing:
            raise ConfigError(f"{self.where}: the static W8A8 weight {name} lacks "
                              f"{', '.join(base + n for n in missing)}")
        s, off, deq, qbias = (self.sd[base + n] for n in STATIC_NAMES)
        if deq.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"{self.where}: {base}deq_scale is {deq.dtype}; pdserve reads "
                              "float deq_scale only (the int64 form is the NPU operator's "
                              "encoding, not documented as a checkpoint format)")
        if s.numel() != 1 or off.numel() != 1:
            raise ConfigError(f"{self.where}: {base}input_scale / input_offset hold "
                              f"{s.numel()} / {off.numel()} values (one per tensor)")
        t = self.sd[name].view(self.sd[name].shape)
        setattr(t, STATIC_ATTR, (float(s), float(off), deq.float(), qbias))
        self.int8_names.add(name)
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.static:
            return self._static(name)
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


STATIC = "W8A8"  # static: activations quantized with the checkpoint's per-tensor scale/offset
STATIC_ATTR = "pd_static_w8a8"  # set on a static W8A8 weight handed out by ModelSlimCheckpoint
STATIC_NAMES = ("input_scale", "input_offset", "deq_scale", "quant_bias")


class StaticInt8Weight:
    """A linear layer's static W8A8 weight (msModelSlim's documented math):
    x_q = clamp(round(x / input_scale + input_offset), -128, 127) with one scale and offset per
    tensor, y = (x_q . w_q + quant_bias) * deq_scale per output channel (quant_bias int32 holds
    the activation offset's term and the layer's float bias, so no float bias is added). Fused
    layers (q/k/v, gate/up) keep one part per checkpoint tensor, each quantizing x with its own
    scale. The sums run on engine/native's int8 GEMM where it serves (it takes [-127, 127]: a
    -128 is computed as -127 minus a second GEMM of the 0/1 rows where it occurs), else
    torch._int_mm."""

    def __init__(self, parts: list[tuple[torch.Tensor, float, float, torch.Tensor,
                                         torch.Tensor]]) -> None:
        from pdcore.engine import native

        self.path = native.int8_path()
        self.parts = []
        for q, s, off, deq, qbias in parts:
            w = (torch.ops.pdcore_native.int8_pack(q.contiguous(), torch.ones(q.shape[0]))
                 if self.path else q.t().contiguous())
            self.parts.append((w, q.shape[0], s, off, deq.float().contiguous(),
                               qbias.to(torch.int32).contiguous()))
        n = sum(p[1] for p in self.parts)
        self.q = torch.empty_strided((n, parts[0][0].shape[1]), (0, 0), dtype=torch.int8)
        self.packed = None  # not the dynamic panels: the native decode loop stays off

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @classmethod
    def of(cls, weights: list[torch.Tensor], rows: list[tuple[int, int]],
           cols: tuple[int, int] | None = None, bias_here: bool = True) -> StaticInt8Weight:
        """From the checkpoint's weights (each with its STATIC_ATTR), row spans per weight (a
        ColumnLinear's shards) or one column span (a RowLinear's: quant_bias on one rank only,
        `bias_here`)."""
        parts = []
        for w, (a, n) in zip(weights, rows):
            s, off, deq, qbias = getattr(w, STATIC_ATTR)
            q = w[a : a + n]
            if cols is not None:
                q = q[:, cols[0] : cols[0] + cols[1]]
            qbias = qbias.reshape(-1)[a : a + n] if bias_here else torch.zeros(n, dtype=torch.int32)
            parts.append((q, s, off, deq.reshape(-1)[a : a + n], qbias))
        return cls(parts)

    def _sums(self, xq: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        if not self.path:
            return torch._int_mm(xq.to(torch.int8), w)
        gemm = torch.ops.pdcore_native.int8_gemm
        acc = gemm(xq.clamp(min=-127).to(torch.int8), w, n, self.path)
        low = xq == -128
        if bool(low.any()):
            acc -= gemm(low.to(torch.int8), w, n, self.path)
        return acc

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()
        outs = []
        for w, n, s, off, deq, qbias in self.parts:
            xq = torch.round(x2 / s + off).clamp_(-128, 127)
            outs.append((self._sums(xq, w, n) + qbias).float() * deq)
        y = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        return y.to(x.dtype).view(*lead, y.shape[-1])


def static_of(weight: torch.Tensor):  # type: ignore[no-untyped-def]
    """(input_scale, input_offset, deq_scale, quant_bias) of a static W8A8 weight, or None."""
    return getattr(weight, STATIC_ATTR, None)
