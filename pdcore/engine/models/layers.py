"""Building blocks written for tensor parallelism: a TP group only changes how weights are
sliced at load time and adds one all-reduce after row-parallel layers.

Shards need not be even: a dimension of `total` rows is split into floor spans
[r*total//size, (r+1)*total//size), so e.g. SmolLM2's 3 KV heads run on 2 ranks as 1 + 2.
Attention heads follow the KV-head groups (`q_head_span`; `kv_head_span` lives in
pdcore.interfaces.geometry because the transfer planners must agree with it); when TP exceeds
the KV head count, each rank holds one (replicated) KV head and a share of its query heads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcore.config import env_bool
from pdcore.errors import ConfigError
from pdcore.interfaces.geometry import kv_head_span, span  # the split rule P and D share


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


# -- small-batch GEMMs on CPU ---------------------------------------------------------------------
# MKL's float32 GEMM is fastest when the activation has exactly PACK_ROWS rows and the weight is
# prepacked for that shape: measured here (1 thread, SmolLM2's 121 matrices) a batch of 8 or 15
# rows costs 130-180 ms through F.linear, 16 rows 120 ms, 16 rows on packed weights 90 ms. A
# decode step has few rows, so `linear` pads 4..16 rows to PACK_ROWS and uses the packed weight;
# 1-3 rows (F.linear is bandwidth-bound there: 49 ms for one row, packed 90) and larger inputs
# (prefill) use F.linear on the original weight. Results agree with F.linear to float32
# rounding (bit-identical in our checks). The packed copy costs one more weight's worth of host
# memory; PDCORE_CPU_PACKED_GEMM=0 turns it off.
PACK_ROWS = 16
PACK_MIN_ROWS = 4
PACKED_GEMM_ENV = "PDCORE_CPU_PACKED_GEMM"


def packed_gemm_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and env_bool(os.environ, PACKED_GEMM_ENV, True)
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL-packed copy of a [out, in] float32 weight for PACK_ROWS-row inputs, or None."""
    if not packed_gemm_available(weight):
        return None
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the packed weight when there is one and x has 4..PACK_ROWS rows."""
    m = x.shape[0]
    if packed is None or x.dim() != 2 or not PACK_MIN_ROWS <= m <= PACK_ROWS:
        return F.linear(x, weight, bias)
    if m < PACK_ROWS:
        x = F.pad(x, (0, 0, 0, PACK_ROWS - m))
    y = torch.ops.mkl._mkl_linear(x.contiguous(), packed, weight, bias, PACK_ROWS)
    return y[:m] if m < PACK_ROWS else y


def pack_linears(module: nn.Module) -> None:
    """Prepack the weight of every ColumnLinear/RowLinear under `module` (where available)."""
    for m in module.modules():
        if isinstance(m, (ColumnLinear, RowLinear)):
            m.packed = pack_weight(m.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        self.weight.copy_(torch.cat([w[a : a + n] for w, (a, n) in zip(weights, self.shards)], 0))
        if self.bias is not None and biases is not None:
            self.bias.copy_(torch.cat([b[a : a + n] for b, (a, n) in zip(biases, self.shards)], 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        a, n = self.shard
        self.weight.copy_(weight[:, a : a + n])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        return y + self.bias if self.bias is not None else y
