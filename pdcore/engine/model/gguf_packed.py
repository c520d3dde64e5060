"""GGUF weights kept packed: the blocks of the file (ggml's layouts) stay in memory as they are,
and the GEMMs read them (engine/native/gguf_gemm.h), instead of a float32 copy made at load.

A packed weight is a uint8 tensor [type, N, row_bytes] whose first dimension has stride 0 (no
bytes): its size is the ggml type number, so the tensor carries its format wherever a float
weight's packed form goes (ColumnLinear.packed, the native decode loop's lists). `typed(rows,
type)` makes one; `type_of`, `rows_of` read it back.

Formats with kernels (PACKED_TYPES): Q8_0, Q4_0, Q4_1 (blocks of 32 weights) and Q4_K, Q6_K
(256). Each weight is the value the `gguf` package's own de-quantization gives (so the float
model made from the same file has the same weights); only the GEMM's summation order differs.

Without the native kernels (PDCORE_NATIVE=0, no compiler) the same weights are de-quantized by
the `gguf` package at each call (`linear_fallback`: slow, for correctness only).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
PACKED_TYPES = frozenset(GGML_TYPES.values())
TYPE_NAMES = {v: k for k, v in GGML_TYPES.items()}


def typed(rows: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The packed weight of `rows` (uint8 [N, row_bytes], GGUF blocks) of `ggml_type`."""
    if ggml_type not in PACKED_TYPES:
        raise ValueError(f"ggml type {ggml_type} has no packed kernel "
                         f"(kernels: {', '.join(GGML_TYPES)})")
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"GGUF rows must be uint8 [N, row_bytes], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    return rows.contiguous().unsqueeze(0).expand(ggml_type, *rows.shape)


def is_packed(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.uint8 and t.dim() == 3 and t.stride(0) == 0


def type_of(t: torch.Tensor) -> int:
    return t.shape[0]


def rows_of(t: torch.Tensor) -> torch.Tensor:
    return t[0]


def in_features(t: torch.Tensor) -> int:
    """K: the weights in one row."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_of(t))]
    return t.shape[2] // size * block


def dequantize(t: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 [N, K] (or the rows `ids`) of a packed weight, by the `gguf` package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = rows_of(t) if ids is None else rows_of(t).index_select(0, ids.reshape(-1).long())
    out = gguf_dequantize(rows.numpy(), GGMLQuantizationType(type_of(t)))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def _native(name: str):
    from pdcore.engine import native

    return native.op(name)


def linear(x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [..., K] W^T (+ bias) for a packed W, in x's dtype."""
    op = _native("gguf_linear")
    if op is not None:
        return op(x, w, n, bias)
    return linear_fallback(x, w, bias)


def linear_fallback(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    y = F.linear(x.float(), dequantize(w), None if bias is None else bias.float())
    return y.to(x.dtype)


def rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows `ids` [...] of a packed W: [..., K]."""
    op = _native("gguf_rows")
    out = op(w, ids) if op is not None else dequantize(w, ids)
    return out.view(*ids.shape, out.shape[-1])


class PackedEmbedding(nn.Module):
    """A token embedding whose table stays packed (GGUF blocks): a lookup de-quantizes the rows
    it reads. `weight` is a stand-in of the table's shape and dtype (no bytes); `packed` holds
    the blocks (an lm_head tied to the embedding reads the same tensor)."""

    def __init__(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.packed = packed
        shape = (packed.shape[1], in_features(packed))
        self.weight = nn.Parameter(torch.empty_strided(shape, (0, 0), dtype=dtype),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return rows(self.packed, ids).to(self.weight.dtype)
