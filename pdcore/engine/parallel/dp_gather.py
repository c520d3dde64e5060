"""DP attention's data plane inside a MoE layer (pdcore.engine.parallel.dp_attention tells the whole
story): the group a DP attention rank belongs to, and the gather of every DP rank's rows before
the experts / the slice of this rank's rows after."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcore.engine.model.layers import TPInfo


@dataclass(frozen=True, slots=True)
class DPAttnTPInfo(TPInfo):
    """The attention group (rank/size/group are its own: what attention, the dense MLPs, the
    scheduler's agreement and sampling see) plus the whole T-rank group for the MoE layers."""

    world: TPInfo | None = None
    dp_rank: int = 0
    dp_size: int = 1
    leaders: object | None = None  # gloo group of every DP rank's first rank
    src: int = 0  # global rank of this attention group's rank 0
    forwards: list[int] = field(default_factory=lambda: [0])  # MoE gathers run so far
    # this forward's rows per DP rank (None: not gathered yet); only cached once the lockstep
    # (DPSync) marks forward starts, as it does on every rank
    counts: list[list[int] | None] = field(default_factory=lambda: [None])
    marked: list[bool] = field(default_factory=lambda: [False])

    def broadcast_object(self, obj: Any = None) -> Any:
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]  # src is a global rank, also inside a subgroup
        dist.broadcast_object_list(box, src=self.src, group=self.cpu_group)
        return box[0]


def gathered(dp: DPAttnTPInfo, x: torch.Tensor,
             fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn over every DP rank's rows (in DP-rank order); this DP rank's rows of the result."""
    import torch.distributed as dist

    world = dp.world
    assert world is not None
    dp.forwards[0] += 1
    a = world.size // dp.dp_size
    per_dp = dp.counts[0]
    if per_dp is None:
        count = torch.tensor([x.shape[0]], dtype=torch.int64)
        counts = [torch.empty_like(count) for _ in range(world.size)]
        dist.all_gather(counts, count, group=world.cpu_group)
        per_dp = [int(counts[d * a]) for d in range(dp.dp_size)]  # an attention group agrees
        if dp.marked[0]:
            dp.counts[0] = per_dp
    elif per_dp[dp.dp_rank] != x.shape[0]:
        raise RuntimeError(f"DP attention: a MoE layer got {x.shape[0]} rows, the forward "
                           f"started with {per_dp[dp.dp_rank]}; the DP ranks no longer match")
    total, most = sum(per_dp), max(per_dp)
    if total == 0:
        return x
    padded = x.new_zeros(most, x.shape[1])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(parts, padded, group=world.group)
    whole = torch.cat([parts[d * a][: per_dp[d]] for d in range(dp.dp_size)])
    out = fn(whole)
    first = sum(per_dp[: dp.dp_rank])
    return out[first : first + x.shape[0]]
