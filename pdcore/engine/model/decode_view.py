"""Decode-time K/V kept contiguous per request between steps, so a steady decode step reads
K/V in place instead of gathering a copy out of the paged pool in every layer.

The pool stays the truth (transfers, prefix sharing and every other path read it); the view is
a cache of the decode batch's contexts, per layer one K and one V buffer of
[B, kv_heads, capacity, head_dim] (the layout SDPA reads fastest). A decode-only step whose
requests are the previous forward's, in the same order, each one token further along the same
slots, only appends its new K/V ("append"); any other step with decodes gathers their contexts
from the pool into the buffers once ("fill"); a forward without decodes invalidates the view.
A step mixing decodes with a prefill chunk uses the view for its decodes (the prefill attends
as before), so a long chunked prefill does not interrupt appending. Measured
on SmolLM2 at batch 8 (1 thread): gathering K/V out of the pool took about 40% of attention.

The buffers cost B x capacity tokens of K/V beside the pool; above `budget` bytes
(PDCORE_DECODE_KV_VIEW_MB, default 128; 0 turns the view off) other pools are gathered as
before. With `prefer_pool` (the loader sets it for a GGUF model served packed) a float32 pool
of a float32 model is not viewed at all: the native paged kernel (engine/native:
decode_attention_paged, attend_heads since s10) reads it in place with the view kernel's bits.
Nor is a bf16 model's bf16 pool (bf16_pool, s13): read in place in the prefill kernel's order.
Served side by side (s11, Zen 5, quiet lock, 64-token prompts, TPOT with the view / without):
packed Q4_1 SmolLM2 batch 8 9.9 / 9.5 ms, batch 1 4.0 / 3.8 (bench/results/gguf_packed_s11.json,
load ~7; probes at load ~11: batch 8 10-19% lower without), peak resident 510 / 457 MiB; the
float32 models were within noise (SmolLM2 batch 8 21.7 / 19.8, batch 1 16.4 / 17.1; the
1B-shaped model batch 8 111.1 / 109.5, batch 1 104.2 / 106.4, bench/decode_view.py,
decode_view_s11_1b.json, load ~11; an earlier run 1.05-1.06x slower without), so they keep it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdcore.engine.kv.fp8 import dequantize, quantize
from pdcore.env import ENV, Env

if TYPE_CHECKING:
    from pdcore.engine.model.batch import DecodeGroup, ForwardBatch

VIEW_MB_ENV = Env.pdcore_decode_kv_view_mb.name
DEFAULT_MB = Env.pdcore_decode_kv_view_mb.default
GROW = 64  # capacity grows in steps of this many tokens, so appends rarely refill


def budget_bytes() -> int:
    return int(ENV.pdcore_decode_kv_view_mb * 2**20)


class DecodeKV:
    """The decode batch's K/V per layer, contiguous per request (see the module docstring)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int,
                 budget: int | None = None) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.budget = budget_bytes() if budget is None else budget
        # True: a pool the paged kernel reads in place is read so, no view (the loader sets it
        # for a GGUF model served packed: measured faster there, not for float32 weights)
        self.prefer_pool = False
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.keys: tuple[object, ...] | None = None  # request keys of the rows, in order
        self.tables: list[torch.Tensor] = []  # the slots each row holds
        self.valid = False
        self.mode = ""  # this forward: "append", "fill" or "" (view not used)
        self.cols = torch.empty(0, dtype=torch.long)  # append: each row's new column
        self.rows = torch.empty(0, dtype=torch.long)

    def begin(self, batch: ForwardBatch, dtype: torch.dtype, *, in_place: bool = False) -> str:
        """Decide how this forward uses the view; call once per forward, before the layers.
        `in_place`: no view, the paged kernel reads this forward's pool as it is (the caller
        passes it when `prefer_pool` and `reads_in_place` both hold).
        The view stays invalid until `end` (a forward that fails midway leaves it so)."""
        was_valid, self.valid, self.mode = self.valid, False, ""
        group = batch.decode_group()
        if self.budget <= 0 or group is None or in_place:
            return ""
        keys = tuple(s.key for s in group.seqs)
        if any(k is None for k in keys):
            return ""
        tables = [s.ctx_slots for s in group.seqs]
        if was_valid and keys == self.keys and self._continues(tables, group):
            self.mode = "append"
            self.cols = torch.tensor([len(t) - 1 for t in tables], dtype=torch.long,
                                     device=self.k[0].device)
        elif self._ensure(len(keys), group.width, dtype, group.table.device):
            self.mode = "fill"
        else:
            return ""
        self.keys, self.tables = keys, tables
        return self.mode

    def release(self) -> None:
        """Free the buffers (the server went idle: no decode batch to keep); the next decode
        step fills them again."""
        self.k, self.v, self.keys, self.tables, self.valid = [], [], None, [], False

    def end(self) -> None:
        """The forward completed: the next one may append."""
        self.valid = bool(self.mode)

    def _continues(self, tables: list[torch.Tensor], group: DecodeGroup) -> bool:
        if group.width > self.k[0].shape[2] or len(tables) != len(self.tables):
            return False
        for new, old in zip(tables, self.tables):
            n = len(old)
            if len(new) != n + 1 or not torch.equal(new[:n], old):
                return False
        return True

    def _ensure(self, rows: int, width: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> bool:
        """Buffers for `rows` x at least `width` tokens of `dtype` on `device` (the pool's);
        False above the budget."""
        if self.k and self.k[0].shape[0] == rows and self.k[0].shape[2] >= width \
                and self.k[0].dtype == dtype and self.k[0].device == torch.device(device):
            return True
        cap = -(-(width + 1) // GROW) * GROW
        elem = torch.empty(0, dtype=dtype).element_size()
        need = 2 * self.num_layers * rows * self.kv_heads * cap * self.head_dim * elem
        self.k, self.v = [], []  # drop the old buffers before making new ones
        if need > self.budget:
            return False
        # zeros, not empty: a row's columns past its length are masked (-inf scores), but a
        # NaN of uninitialised memory there would still turn 0 * NaN into NaN in P @ V
        shape = (rows, self.kv_heads, cap, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.rows = torch.arange(rows, device=device)
        return True

    def layer(self, i: int, k_new: torch.Tensor, v_new: torch.Tensor, k_flat: torch.Tensor,
              v_flat: torch.Tensor, g: DecodeGroup, *, scales: tuple[float, float] = (1.0, 1.0)
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V of the decode batch as [B, kv_heads, width, head_dim] views, after
        adding this step's K/V (k_new, v_new: [B, kv_heads, head_dim]; already in the pool).
        `scales`: an FP8 pool's K and V scales (the view holds de-quantized values)."""
        kb, vb = self.k[i], self.v[i]
        B, W = kb.shape[0], g.width
        if self.mode == "append":
            # through the pool's dtype: the same numbers a fill would read back
            kb[self.rows, :, self.cols] = _through(k_new, k_flat.dtype, kb.dtype, scales[0])
            vb[self.rows, :, self.cols] = _through(v_new, v_flat.dtype, vb.dtype, scales[1])
        else:
            shape = (B, W, self.kv_heads, self.head_dim)
            for buf, flat, sc in ((kb, k_flat, scales[0]), (vb, v_flat, scales[1])):
                rows = flat.index_select(0, g.table).view(shape).transpose(1, 2)
                buf[:, :, :W].copy_(dequantize(rows, buf.dtype, sc))
        return kb[:, :, :W], vb[:, :, :W]


# the dtypes the native paged decode kernel takes, of queries and of the pool (a bf16 pool's
# values widened as they are read: the sums over a float32 view's copies of them)
PAGED = (torch.float32, torch.bfloat16)
# the pools it reads in place: those and FP8, each value widened as it is read and times the
# layer's scale (float(x) * scale: dequantize's value over a float32 view, and the prefill
# kernel's pf_widen, so a row has the same bits in both phases; a bf16 model attends over FP8 in
# float32, as through its float32 view)
POOLS = PAGED + (torch.float8_e4m3fn, torch.float8_e5m2)


def widened(fn):
    """The paged decode kernel `fn` for bf16 queries: its mask in float32, the output (float32)
    back in the queries' dtype. The queries go in as bf16: over a bf16 pool the kernel takes
    the bf16 order of attn_block.h where the CPU has vdpbf16ps (the prefill kernel's, so a row
    has the same bits in both phases), else widens them as over a float32 pool."""
    def run(q, k_flat, v_flat, table, bias, scale, *scales):  # scales: the pool's K, V (FP8)
        o = fn(q, k_flat, v_flat, table, None if bias is None else bias.float(), scale, *scales)
        return o.to(q.dtype)
    return run


def bf16_pool(h: torch.Tensor, pool: torch.Tensor) -> bool:
    """A bf16 model over a bf16 pool: never viewed (a float32 view would attend in the widening
    order while the prefill kernel takes the bf16 one, engine/native/bf16_attn.h; and in place
    it is faster: s12, SmolLM2 b4 x 4096, 37.4 ms a step against the view's 59.9)."""
    return h.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16


def reads_in_place(h: torch.Tensor, pool: torch.Tensor) -> bool:
    """The native paged decode kernel reads `pool` as it is for a model whose activations are
    `h`'s: h of PAGED, the pool of POOLS, on the CPU, the pool contiguous, the kernels built."""
    if h.dtype not in PAGED or pool.dtype not in POOLS or pool.device.type != "cpu" \
            or h.device.type != "cpu" or not pool.is_contiguous():
        return False
    from pdcore.engine.model.base import _native_op

    return _native_op("decode_attention_paged") is not None


def _through(x: torch.Tensor, pool: torch.dtype, view: torch.dtype, scale: float
             ) -> torch.Tensor:
    """x as the pool stores it, read back as the view's dtype."""
    return dequantize(quantize(x, pool, scale), view, scale)
