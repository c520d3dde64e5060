"""Building blocks written for tensor parallelism: a TP group only changes how weights are
sliced at load time and adds one all-reduce after row-parallel layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed process group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x


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
    sub-matrices fused into one weight (e.g. q, k, v): each is sharded separately."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, tp: TPInfo) -> None:
        super().__init__()
        for p in parts:
            assert p % tp.size == 0, f"{p} output features not divisible by tp {tp.size}"
        self.parts = parts
        self.tp = tp
        out = sum(parts) // tp.size
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        def shard(t: torch.Tensor, full: int) -> torch.Tensor:
            n = full // self.tp.size
            return t[self.tp.rank * n : (self.tp.rank + 1) * n]

        self.weight.copy_(torch.cat([shard(w, p) for w, p in zip(weights, self.parts)], 0))
        if self.bias is not None and biases is not None:
            self.bias.copy_(torch.cat([shard(b, p) for b, p in zip(biases, self.parts)], 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """Input features split across TP ranks; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo) -> None:
        super().__init__()
        assert in_features % tp.size == 0
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n = weight.shape[1] // self.tp.size
        self.weight.copy_(weight[:, self.tp.rank * n : (self.tp.rank + 1) * n])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
