"""Building blocks written for tensor parallelism: a TP group only changes how weights are
sliced at load time and adds one all-reduce after row-parallel layers.

Shards need not be even: a dimension of `total` rows is split into floor spans
[r*total//size, (r+1)*total//size), so e.g. SmolLM2's 3 KV heads run on 2 ranks as 1 + 2.
Attention heads follow the KV-head groups (`q_head_span`; `kv_head_span` lives in
pdcore.interfaces.geometry because the transfer planners must agree with it); when TP exceeds
the KV head count, each rank holds one (replicated) KV head and a share of its query heads.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.env import ENV, Env
from pdcore.engine.cpu_features import gemm_layout_setting
from pdcore.engine.model import gguf_packed
from pdcore.engine.model.fp8 import Fp8Weight, fp8_of
from pdcore.engine.model.modelslim import StaticInt8Weight, static_of
from pdcore.engine.model.quant import Int8Weight, scale_of
from pdcore.errors import ConfigError
from pdcore.interfaces.geometry import kv_head_span, span  # the split rule P and D share

log = logging.getLogger(__name__)


def q_head_span(num_heads: int, total_kv: int, rank: int, size: int) -> tuple[int, int]:
    """Query heads a rank computes; always inside the groups of its KV heads."""
    if num_heads % total_kv:
        raise ConfigError(f"{num_heads} attention heads are not a multiple of {total_kv} KV heads")
    group = num_heads // total_kv
    k0, kn = kv_head_span(total_kv, rank, size)
    if size <= total_kv:
        return k0 * group, kn * group
    replicas = [r for r in range(size) if r * total_kv // size == k0]
    first, n = span(group, replicas.index(rank), len(replicas))
    if n == 0:
        raise ConfigError(f"--tp-size {size} is too large: with {num_heads} attention heads and "
                          f"{total_kv} KV heads some rank would get no attention head")
    return k0 * group + first, n


def share_host_threads(ways: int) -> None:
    """This process's slice of the host's cores when `ways` engine processes share it:
    oversubscribed intra-op threads spin against each other and the collectives (a step gets
    several times slower, not faster)."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // ways)))


@dataclass(frozen=True, slots=True)
class TPInfo:
    """This rank's place in its TP group plus the collectives the engine needs.

    `group` carries the tensors of the forward pass (gloo on cpu, nccl/hccl on accelerators);
    `cpu_group` (gloo) carries scheduler agreement: step inputs, sampled tokens, poll states.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed process group
    cpu_group: object | None = None
    ep_size: int = 1  # MoE: 1 = experts sharded like the MLP; == size: whole experts per rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (others pass anything)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over ranks (every rank passes the same number of values)."""
        if self.size == 1 or not values:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [int(v) for v in t.tolist()]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


# -- GEMMs on CPU ---------------------------------------------------------------------------------
# Linear layers run on a copy of the weight laid out once at load for the kernel that reads it,
# and that copy *replaces* the original (one copy of the weights); the original becomes a
# zero-stride stand-in of the right shape and dtype (no bytes), so code reading `.shape` /
# `.dtype` keeps working. Two layouts:
# - panels of 32 output features (engine/native, where the native kernels are built): float32
#   [ceil(N / 32), K, 32] on AVX-512 (pdcore_native::linear), bf16 [ceil(N / 32), K / 2, 32, 2]
#   on AVX-512 BF16 (linear_bf16);
# - oneDNN's reordered weight (its blocked layout for the CPU: AMX tiles for bf16 where the CPU
#   has AMX).
# Which is faster depends on the CPU, so each weight shape is timed once at load in both layouts
# (`choose_layout`; PDCORE_GEMM_LAYOUT=panels|onednn fixes it). Seen on two machines of this
# project, 2 threads, SmolLM2's matrices: on AMD Zen 4 (AVX-512 BF16, no AMX) panels read the
# weights at 24-30 GB/s against oneDNN's 15-22 (float32 decode step 3.2 against 5.6 ms a layer;
# bf16 0.40 against 0.55), within 0-3% at prefill sizes (Llama-1B's matrices, 128-1024 rows:
# 210-223 against 214-226 GFLOP/s; 136-182 before the panel GEMM packed x's tiles); on an Intel Xeon with AMX, oneDNN wins:
# bf16 1.4 against 3.2 ms at 8 rows (all layers' shapes once + lm_head), 3.6 against 37 ms at
# 1024 rows (AMX), float32 4.5 against 5.6 at 8 rows.
# Results differ from F.linear only in float32 rounding (another summation order; greedy outputs
# still equal transformers'). PDCORE_CPU_PACKED_GEMM=0 turns both off (F.linear on the original).
PACK_ROWS = 16  # the batch size oneDNN is told to expect (a hint: any row count works)
PACKED_GEMM_ENV = Env.pdcore_cpu_packed_gemm.name
PACKED_DTYPES = (torch.float32, torch.bfloat16)
PANEL = 32  # output features per panel (pdcore_native::linear)
# choose_layout's workload: a decode step of DECODE_ROWS sequences weighs DECODE_WEIGHT against
# one prefill chunk of PREFILL_ROWS tokens (a chat turn of ~128 tokens in and ~64 out at batch 8
# runs ~8 decode steps per 0.5 such chunks: decode-heavy)
DECODE_ROWS, PREFILL_ROWS, DECODE_WEIGHT = 8, 256, 16
# oneDNN's layout replaces the panels only when its weighted cost is at least this much lower:
# the timing runs once at load, on whatever else the machine is doing, and a near tie is
# noise. On this project's Zen 4 (2 cores, shared), 45 SmolLM2 float32 server starts of
# bench/vs_vllm.py logged all 121 weights in panels 40 times, and 1, 30 or 60 of them (whole
# shapes) in oneDNN's layout 5 times, whose decode steps are the slower (5.6 against 3.2 ms a
# layer at 8 rows). Where oneDNN really wins (AMX: bf16 1.4 against 3.2 ms, float32 4.5
# against 5.6) it wins by more than this.
ONEDNN_MARGIN = 0.10
STREAM_BYTES = 32 << 20  # layout_cost's decode timing reads at least this much weight
# reps of each layout per row count, interleaved with the other layout's (cheap: once per shape;
# odd, so the median of the paired ratios is one pair's)
LAYOUT_REPS = 7
_clock = time.perf_counter  # layout_cost's clock (tests stand in a clock of their own)
_layout_choice: dict[tuple, str] = {}


def packed_gemm_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
            and ENV.pdcore_cpu_packed_gemm
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _padded_rows(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(weight with zero rows appended up to a whole number of panels, panel count)."""
    n, k = weight.shape
    p = -(-n // PANEL)
    padded = torch.zeros(p * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded, p


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 32), K, 32]: panel p holds output features 32p..32p+31 (zero rows pad
    the last), each k's 32 weights contiguous."""
    padded, p = _padded_rows(weight)
    return padded.view(p, PANEL, -1).transpose(1, 2).contiguous()


def pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> [ceil(N / 32), K / 2, 32, 2]: as `pack_panels`, with each
    output's weights for k and k + 1 side by side (the pairs vdpbf16ps multiplies)."""
    padded, p = _padded_rows(weight)
    return padded.view(p, PANEL, -1, 2).permute(0, 2, 1, 3).contiguous()


def _panel_packer(weight: torch.Tensor):
    """pack_panels / pack_panels_bf16 where the native GEMM takes this weight, else None."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    from pdcore.engine import native

    if weight.dtype == torch.float32 and native.panel_gemm():
        return pack_panels
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and native.bf16_gemm():
        return pack_panels_bf16
    return None


def _onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def layout_cost(weight: torch.Tensor, panels: torch.Tensor, onednn: torch.Tensor,
                rows: int, reps: int = LAYOUT_REPS) -> dict[str, list[float]]:
    """Milliseconds of one GEMM of `rows` random rows in each layout, `reps` times each, the two
    layouts interleaved rep by rep (after a warm call of each: oneDNN builds its primitive on
    first use), so a burst of other load on the machine hits both layouts' reps alike and
    choose_layout can compare them pair by pair. The order within a pair alternates (A B, B A)
    so neither layout always runs second. At decode sizes a step streams each weight from memory
    once, so the timing cycles through copies of the weight that together exceed the caches
    nearest the core (STREAM_BYTES); a weight that stays in L2 would flatter the kernel that
    computes best over data the core already holds."""
    copies = 1
    if rows <= DECODE_ROWS:
        copies = max(1, min(8, -(-STREAM_BYTES // (weight.numel() * weight.element_size()))))
    x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
    ws = {"panels": [panels] + [panels.clone() for _ in range(copies - 1)],
          "onednn": [onednn] + [_onednn(weight) for _ in range(copies - 1)]}
    out: dict[str, list[float]] = {"panels": [], "onednn": []}

    def run(name: str) -> float:
        t = _clock()
        for w in ws[name]:
            linear(x, weight, None, w)
        return (_clock() - t) * 1e3 / copies

    with torch.inference_mode():
        run("panels"), run("onednn")  # warm
        for i in range(reps):
            for name in (("panels", "onednn") if i % 2 == 0 else ("onednn", "panels")):
                out[name].append(run(name))
    return out


def choose_layout(weight: torch.Tensor, panels: torch.Tensor, onednn: torch.Tensor,
                  prefill: bool = True) -> str:
    """'panels' or 'onednn' for this weight's (dtype, N, K), decided once per process from the
    cost of DECODE_WEIGHT decode GEMMs of DECODE_ROWS rows plus (`prefill`) one of PREFILL_ROWS
    rows, each rep of the two layouts timed side by side (layout_cost). oneDNN's layout only
    when it is cheaper by ONEDNN_MARGIN both in the ratio of the layouts' best reps and in the
    median of the per-rep ratios: a burst of load that slows some of one layout's reps moves
    neither (the best reps are the quiet ones; the median outvotes the burst's pairs), and one
    that lasts the whole timing slows both layouts alike. An lm_head only ever sees
    decode-sized row counts."""
    n, k = weight.shape
    key = (weight.dtype, n, k, prefill)
    if key not in _layout_choice:
        cost = {"panels": [0.0] * LAYOUT_REPS, "onednn": [0.0] * LAYOUT_REPS}
        for rows, w in ((DECODE_ROWS, DECODE_WEIGHT), (PREFILL_ROWS, 1))[: 2 if prefill else 1]:
            for name, ms in layout_cost(weight, panels, onednn, rows).items():
                cost[name] = [c + w * m for c, m in zip(cost[name], ms)]
        best = min(cost["onednn"]) / min(cost["panels"])
        median = statistics.median(o / p for o, p in zip(cost["onednn"], cost["panels"]))
        win = best < 1 - ONEDNN_MARGIN and median < 1 - ONEDNN_MARGIN
        _layout_choice[key] = "onednn" if win else "panels"
        log.info("GEMM layout for %s [%d, %d]%s: %s (oneDNN/panels weighted cost: best %.2f, "
                 "median of %d paired reps %.2f; oneDNN needs both < %.2f)", weight.dtype, n, k,
                 "" if prefill else " (decode rows only)", _layout_choice[key], best,
                 LAYOUT_REPS, median, 1 - ONEDNN_MARGIN)
    return _layout_choice[key]


def weight_layouts(model: nn.Module) -> dict[str, int]:
    """How many of `model`'s GEMM weights sit in each layout: panels, oneDNN's, plain (not
    packed) or int8 (W8A8), counting every linear layer and an lm_head (for logs and
    /metrics)."""
    out = {"panels": 0, "onednn": 0, "plain": 0, "int8": 0, "fp8": 0, "gguf": 0}
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    out["int8"] = sum(m.int8 is not None for m in linears)
    out["fp8"] = sum(m.fp8 is not None for m in linears)
    packed = [m.packed for m in linears if m.int8 is None and m.fp8 is None]
    if hasattr(model, "lm_head_packed"):
        packed.append(model.lm_head_packed)
    for p in packed:
        out["plain" if p is None else "int8" if isinstance(p, Int8Weight)
            else "gguf" if gguf_packed.is_packed(p)
            else "panels" if p.layout == torch.strided else "onednn"] += 1
    return out


def pack_weight(weight: torch.Tensor, prefill: bool = True) -> torch.Tensor | None:
    """The weight in its GEMM layout (panels or oneDNN's), or None where neither applies;
    `prefill`: whether prefill-sized row counts reach it (not an lm_head)."""
    if not packed_gemm_available(weight):
        return None
    setting = gemm_layout_setting()
    packer = _panel_packer(weight) if setting != "onednn" else None
    if packer is None:
        return _onednn(weight)
    panels = packer(weight.detach())
    if setting == "panels":
        return panels
    onednn = _onednn(weight)
    return panels if choose_layout(weight, panels, onednn, prefill) == "panels" else onednn


def stand_in(weight: torch.Tensor) -> torch.Tensor:
    """A tensor of `weight`'s shape and dtype that holds one element (zero strides)."""
    return torch.empty_strided(weight.shape, (0,) * weight.dim(), dtype=weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | Int8Weight | None = None) -> torch.Tensor:
    """F.linear, through the packed weight when there is one (then `weight` may be its
    stand-in and is only asked for its shape); an Int8Weight (a W8A8 model's int8 lm_head,
    quant.int8_lm_head) computes its int8 GEMM; bf16 pair panels under float32 x (a W8A8
    model's bf16_dot lm_head) give float32 out."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, Int8Weight):
        return packed(x, bias)
    if gguf_packed.is_packed(packed):  # GGUF blocks (gguf_packed.py)
        return gguf_packed.linear(x, packed, weight.shape[0], bias)
    if packed.layout == torch.strided:  # panels: float32 [P, K, 32], bf16 [P, K/2, 32, 2]
        ops = torch.ops.pdcore_native
        # bf16 pair panels under float32 x: a W8A8 model's bf16_dot lm_head (x rounded to
        # bf16, float32 out: loader.bf16_dot_lm_head)
        op = ops.linear if packed.dim() == 3 else ops.linear_bf16 \
            if x.dtype == torch.bfloat16 else ops.linear_bf16_f32
        return op(x, packed, weight.shape[0], bias)
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none",
                                           [], "")
    return y.view(*lead, y.shape[-1]) if x.dim() != 2 else y


def pack_in_place(weight: nn.Parameter, prefill: bool = True
                  ) -> tuple[nn.Parameter, torch.Tensor | None]:
    """(what to keep as the weight, its packed form or None): where a packed form is made it
    replaces the original, which becomes a stand-in (one copy of the weight). `prefill`: as in
    pack_weight."""
    packed = pack_weight(weight, prefill)
    if packed is None:
        return weight, None
    return nn.Parameter(stand_in(weight), requires_grad=False), packed


def pack_linears(module: nn.Module) -> None:
    """Pack the weight of every ColumnLinear/RowLinear under `module` (where available; not
    those loaded packed from GGUF blocks); the packed weight replaces the original."""
    for m in module.modules():
        if (isinstance(m, (ColumnLinear, RowLinear)) and m.int8 is None and m.fp8 is None
                and m.packed is None):
            m.weight, m.packed = pack_in_place(m.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.bfloat16):
            # one op instead of six. float32: the same roundings as transformers' formula below
            # (x * rsqrt(mean(x^2) + eps), times the weight), so greedy identity holds. bf16:
            # computed in float32 and rounded once (the formula rounds before the weight too):
            # closer to the float32 model, and bf16 promises closeness, not identity
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ColumnLinear(nn.Module):
    """y = x W^T (+ b); output features split across TP ranks. `parts` lists the logical
    sub-matrices fused into one weight (e.g. q, k, v): each is sharded separately, by default
    into floor spans, or by the explicit (first_row, rows) `shards` given per part."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, tp: TPInfo,
                 shards: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.shards = shards or [span(p, tp.rank, tp.size) for p in parts]
        assert len(self.shards) == len(parts)
        for (first, n), p in zip(self.shards, parts):
            assert 0 <= first and first + n <= p, f"shard {first}+{n} outside {p} features"
        self.parts = parts
        self.tp = tp
        out = sum(n for _, n in self.shards)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # see pack_linears
        self.int8: Int8Weight | StaticInt8Weight | None = None  # W8A8 (quant.py, modelslim.py)
        self.fp8: Fp8Weight | None = None  # an FP8 checkpoint's weight (fp8.py)

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        rows = [w[a : a + n] for w, (a, n) in zip(weights, self.shards)]
        fp8 = [fp8_of(w) for w in weights]
        if all(f is not None for f in fp8):  # FP8 (fp8.py): kept 8-bit with its scales
            self.fp8 = Fp8Weight.cat([f.rows(a, n) for f, (a, n) in zip(fp8, self.shards)])
            self.weight = nn.Parameter(stand_in(self.weight), requires_grad=False)
        elif all(static_of(w) is not None for w in weights):  # static W8A8 (modelslim.py)
            self.int8 = StaticInt8Weight.of(weights, self.shards)
            self.weight = nn.Parameter(stand_in(self.weight), requires_grad=False)
            self.bias = None  # quant_bias carries it
        elif rows[0].dtype == torch.int8:  # W8A8 (engine/model/quant.py): kept int8 with its scales
            self.int8 = Int8Weight(torch.cat(rows, 0), torch.cat(
                [scale_of(w)[a : a + n] for w, (a, n) in zip(weights, self.shards)]))
            self.weight = nn.Parameter(self.int8.q, requires_grad=False)
            self.packed = self.int8.packed  # the native int8 panels (the decode loop takes them)
        elif rows[0].dtype == torch.uint8:  # GGUF blocks (gguf_packed.py): kept packed
            self.packed = gguf_packed.packed_parts(weights, rows)
            if self.packed is None:  # parts of different types: de-quantized
                self.weight.copy_(torch.cat(gguf_packed.float_rows(weights, rows), 0))
            else:
                self.weight = nn.Parameter(stand_in(self.weight), requires_grad=False)
        else:
            self.weight.copy_(torch.cat(rows, 0))
        if self.bias is not None and biases is not None:
            self.bias.copy_(torch.cat([b[a : a + n] for b, (a, n) in zip(biases, self.shards)], 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8(x, self.bias)
        if self.fp8 is not None:
            return self.fp8(x, self.bias)
        return linear(x, self.weight, self.bias, self.packed)


class RowLinear(nn.Module):
    """Input features split across TP ranks (floor span, or `shard` = (first, count));
    partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo,
                 shard: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.shard = shard or span(in_features, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(out_features, self.shard[1]), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # see pack_linears
        self.int8: Int8Weight | StaticInt8Weight | None = None  # W8A8 (quant.py, modelslim.py)
        self.fp8: Fp8Weight | None = None  # an FP8 checkpoint's weight (fp8.py)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        a, n = self.shard
        fp8 = fp8_of(weight)
        if static_of(weight) is not None:  # static W8A8: quant_bias (and any bias) on rank 0
            self.int8 = StaticInt8Weight.of([weight], [(0, weight.shape[0])], (a, n),
                                            self.tp.rank == 0)
            self.weight = nn.Parameter(stand_in(self.weight), requires_grad=False)
            self.bias = None
            return
        if fp8 is not None:  # FP8: this rank's input features (whole K-blocks)
            try:
                self.fp8 = Fp8Weight.cat([fp8.cols(a, n)])
            except ValueError as e:
                raise ConfigError(f"{e}: choose a --tensor-parallel-size that splits the "
                                  "weight's blocks") from None
            self.weight = nn.Parameter(stand_in(self.weight), requires_grad=False)
        elif weight.dtype == torch.int8:  # W8A8: each rank's partial sum is dequantized, then reduced
            self.int8 = Int8Weight(weight[:, a : a + n], scale_of(weight))
            self.weight = nn.Parameter(self.int8.q, requires_grad=False)
            self.packed = self.int8.packed
        elif weight.dtype == torch.uint8:  # GGUF blocks (gguf_packed.py): whole rows only
            if self.tp.size != 1:
                raise ConfigError("GGUF weights served packed are not sharded by input feature "
                                 "(--tensor-parallel-size 1, or PDCORE_GGUF_PACKED=0)")
            self.packed = gguf_packed.packed_parts([weight], [weight])
            self.weight = nn.Parameter(stand_in(self.weight), requires_grad=False)
        else:
            self.weight.copy_(weight[:, a : a + n])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.int8(x) if self.int8 is not None
                               else self.fp8(x) if self.fp8 is not None
                               else linear(x, self.weight, None, self.packed))
        return y + self.bias if self.bias is not None else y
