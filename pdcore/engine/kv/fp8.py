"""FP8 KV pools (--kv-cache-dtype fp8_e4m3 | fp8_e5m2, SGLang's names): the pool stores
torch.float8_e4m3fn / float8_e5m2, one byte an element, so the same memory holds twice bf16's
tokens and a PD transfer moves half of bf16's bytes.

Writes quantize (x / scale, clamped to the format's finite range, then cast); reads
de-quantize (cast to the compute dtype, times scale). The scale is per layer and per K / V: the
checkpoint's `self_attn.k_scale` / `v_scale` (or compressed-tensors' `k_proj.output_scale` /
`v_proj.output_scale`) where it has them, else 1.0, as SGLang does. For pools of any other
dtype these helpers are the plain casts (scale ignored)."""

from __future__ import annotations

import torch

FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in the pool's dtype: for FP8, x / scale clamped to the finite range (a cast alone
    turns an out-of-range e4m3 value into NaN)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    if scale != 1.0:
        x = x / scale
    big = torch.finfo(dtype).max
    return x.float().clamp(-big, big).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Pool values (any dtype) as `dtype`, times the scale for FP8."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.to(dtype)
    return y * scale if scale != 1.0 else y


def store_rows(flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
               scale: float = 1.0) -> None:
    """flat[slots] = x, quantized for an FP8 pool (through a byte view: CPU index_copy_ has
    no FP8 kernel)."""
    q = quantize(x, flat.dtype, scale)
    if is_fp8(flat.dtype):
        flat.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, q)
