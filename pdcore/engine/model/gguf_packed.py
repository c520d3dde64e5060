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

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
PACKED_TYPES = frozenset(GGML_TYPES.values())
TYPE_NAMES = {v: k for k, v in GGML_TYPES.items()}
# (weights per block, bytes per block) of the packed and float types, as ggml defines them (the
# `gguf` package's GGML_QUANT_SIZES; a test holds them equal): a packed model's load reads a
# file of these types without importing `gguf`, which with its `yaml` costs the engine ~2 MiB
# resident for good; another type asks the package (`quant_size`)
QUANT_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144),
               14: (256, 210), 30: (1, 2)}
FLOAT_NAMES = {0: "F32", 1: "F16", 30: "BF16"}


def quant_size(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type."""
    if ggml_type in QUANT_SIZES:
        return QUANT_SIZES[ggml_type]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def type_name(ggml_type: int) -> str:
    """A ggml type's name (Q4_1, F32, ...)."""
    name = TYPE_NAMES.get(ggml_type) or FLOAT_NAMES.get(ggml_type)
    if name is None:
        from gguf import GGMLQuantizationType

        name = GGMLQuantizationType(ggml_type).name
    return name


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


X16 = 64  # + a ggml type: its blocks regrouped 16 rows at a time for the integer dot (`for_gemm`)
X16_TYPES = frozenset((GGML_TYPES["Q4_0"], GGML_TYPES["Q4_1"], GGML_TYPES["Q8_0"]))


def base_type(t: torch.Tensor) -> int:
    """The ggml type of a packed weight's blocks (in the file's layout or regrouped)."""
    return type_of(t) % X16


def for_gemm(t: torch.Tensor) -> torch.Tensor:
    """The packed weight as the decode GEMM reads it fastest: where the native kernels serve
    with the integer dot (native.gguf_path() 1 or 2) and the weight is Q8_0, Q4_0 or Q4_1 with a
    multiple of 16 rows, its blocks regrouped 16 rows at a time (engine/native/gguf_x16.h: the
    same bytes in another order, the file's layout freed); else `t` as it is."""
    if type_of(t) not in X16_TYPES or t.shape[1] % 16:
        return t
    from pdcore.engine import native

    op = native.op("gguf_repack")
    if op is None or native.gguf_path() not in (1, 2):
        return t
    return op(t)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    return t[0]


def in_features(t: torch.Tensor) -> int:
    """K: the weights in one row."""
    block, size = quant_size(base_type(t))
    return t.shape[2] // size * block


def dequantize(t: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 [N, K] (or the rows `ids`) of a packed weight, by the `gguf` package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    if type_of(t) >= X16:  # regrouped (for_gemm): made, and so read, by the native kernels
        from pdcore.engine import native

        ids = torch.arange(t.shape[1]) if ids is None else ids.reshape(-1).long()
        return native.op("gguf_rows")(t, ids)
    rows = rows_of(t) if ids is None else rows_of(t).index_select(0, ids.reshape(-1).long())
    out = gguf_dequantize(rows.numpy(), GGMLQuantizationType(type_of(t)))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def _native(name: str):
    from pdcore.engine import native

    op = native.op(name)
    if op is not None:
        native.gguf_path()  # once: PDCORE_GGUF_DOT and the CPU choose the GEMM's path (logged)
    return op


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


# -- the GGUF file's tensors by HF name -----------------------------------------------------------
TYPE_ATTR = "pd_ggml_type"  # set on the uint8 rows [N, row_bytes] GGUFCheckpoint hands out
ARCHS = ("llama",)  # GGUF `general.architecture` values whose tensors this reader maps
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_OUTER_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str | None:
    if name in _OUTER_NAMES:
        return _OUTER_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's conversion of a q or k projection (it interleaves
    each head's two rotary halves for its own rotary; transformers reverses it the same way
    when it reads a GGUF): row i of the HF weight is row perm[i] of the file's."""
    idx = torch.arange(n)
    return idx.view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first ([N, K] for a matrix)
    qtype: int  # ggml type number
    data: np.ndarray  # a view of the mapped file: uint8 [N, row_bytes] or the float values


def read_tensors(path: str) -> tuple[str, dict[str, TensorInfo]]:
    """(general.architecture, the tensors by GGUF name) of a GGUF file, its data mapped, not
    read. The metadata is skipped value by value (quant_config's reader): gguf.GGUFReader
    decodes all of it (the tokenizer's ~100k strings), ~3 s here and 12 s on a loaded machine."""
    import mmap
    import struct

    from pdcore.engine.model.quant_config import gguf_skip_value

    arch, align = "?", 32
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF" or struct.unpack("<I", f.read(4))[0] < 2:
            raise ValueError(f"{path} is not a GGUF file (v2 or later)")
        count, nkeys = struct.unpack("<QQ", f.read(16))
        for _ in range(nkeys):
            (n,) = struct.unpack("<Q", f.read(8))
            key = f.read(n).decode("utf-8", "replace")
            (vtype,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and vtype == 8:
                (n,) = struct.unpack("<Q", f.read(8))
                arch = f.read(n).decode("utf-8", "replace")
            elif key == "general.alignment" and vtype == 4:
                (align,) = struct.unpack("<I", f.read(4))
            else:
                gguf_skip_value(f, vtype)
        infos = []
        for _ in range(count):
            (n,) = struct.unpack("<Q", f.read(8))
            name = f.read(n).decode("utf-8", "replace")
            (ndim,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack(f"<{ndim}Q", f.read(8 * ndim))
            qtype, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        start = -(-f.tell() // align) * align
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, size = quant_size(qtype)
        if qtype in (0, 1):  # F32, F16
            dt = np.float32 if qtype == 0 else np.float16
            n = int(np.prod(shape))
            data = np.frombuffer(buf, dt, n, start + offset).reshape(shape)
        else:
            rb = shape[-1] // block * size
            rows = int(np.prod(shape[:-1]))
            data = np.frombuffer(buf, np.uint8, rows * rb, start + offset).reshape(rows, rb)
        tensors[name] = TensorInfo(name, shape, qtype, data)
    return arch, tensors


class GGUFCheckpoint:
    """The tensors of a GGUF file by HF name (a mapping for the models' load code): float types
    as float32 tensors, the packed types as owned uint8 rows [N, row_bytes] carrying their ggml
    type (TYPE_ATTR); q/k rows in HF's order. Other quantized types (Q5_0, Q3_K, ...) are
    de-quantized here by the `gguf` package (logged)."""

    def __init__(self, path: str, cfg) -> None:
        arch, tensors = read_tensors(path)
        if arch not in ARCHS:
            raise ValueError(f"GGUF architecture {arch!r}: packed serving maps {', '.join(ARCHS)}")
        self.tensors = {}
        for t in tensors.values():
            name = hf_name(t.name)
            if name is not None:
                self.tensors[name] = t
        self.heads = {"self_attn.q_proj.weight": cfg.num_attention_heads,
                      "self_attn.k_proj.weight": getattr(cfg, "num_key_value_heads", None)
                      or cfg.num_attention_heads}
        self.dequantized: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        qtype = t.qtype
        if qtype in PACKED_TYPES:
            out = torch.from_numpy(np.array(t.data, copy=True))  # owned: not the mapped file
        else:
            data = t.data
            if qtype not in (0, 1):  # F32, F16
                from gguf import GGMLQuantizationType
                from gguf.quants import dequantize as gguf_dequantize

                data = gguf_dequantize(data, GGMLQuantizationType(qtype))
                self.dequantized.add(f"{name} ({type_name(qtype)})")
            out = torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
        suffix = name.split(".", 3)[-1]
        heads = self.heads.get(suffix) if name.startswith("model.layers.") else None
        if heads:
            out = out.index_select(0, unpermute_rows(out.shape[0], heads))
        if qtype in PACKED_TYPES:
            setattr(out, TYPE_ATTR, qtype)
        return out

    def summary(self) -> str:
        """How many tensors of each ggml type, e.g. 'Q4_1 210, Q8_0 1, F32 61'."""
        from collections import Counter

        counts = Counter(type_name(t.qtype) for t in self.tensors.values())
        return ", ".join(f"{k} {v}" for k, v in counts.most_common())

    def get(self, name: str, default=None):
        return self[name] if name in self.tensors else default

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def packed_parts(weights: list[torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor | None:
    """The packed weight of a (fused) linear layer from its parts' GGUF rows (`weights`: the
    checkpoint's tensors, carrying their type; `rows`: this rank's rows of each), or None where
    the parts' types differ (the layer then takes the de-quantized float weight)."""
    types = {getattr(w, TYPE_ATTR, None) for w in weights}
    if len(types) != 1 or None in types:
        return None
    return for_gemm(typed(torch.cat(rows, 0) if len(rows) > 1 else rows[0], types.pop()))


def float_rows(weights: list[torch.Tensor], rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parts de-quantized (a fused layer whose parts' GGUF types differ)."""
    return [dequantize(typed(r, getattr(w, TYPE_ATTR))) if r.dtype == torch.uint8 else r
            for w, r in zip(weights, rows)]
