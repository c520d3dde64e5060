"""`--enable-dp-attention` (MoE models): attention and KV per DP rank, experts over every rank.

SGLang's meaning: the server's `--tp-size` T ranks split into `--dp-size` D attention groups of
A = T / D ranks. DP rank d owns ranks d*A .. d*A+A-1; it has its own scheduler, its own KV pool
and its own requests, and runs attention (and any dense MLP) TP-sharded over its A ranks. The MoE
layers span all T ranks: their experts are sharded over T (TP experts) or placed whole on each
of the T ranks (`--ep-size T`).

How a MoE layer runs here (torch.distributed; gloo on CPU):
1. every rank tells every other how many token rows its DP rank brings (an all-gather of one
   count: the sizes differ from rank to rank); once per forward pass, by its first MoE layer,
   since every MoE layer of a forward sees the same rows (the lockstep marks where a forward
   starts);
2. the rows are all-gathered (padded to the largest count) and concatenated in DP-rank order,
   so every rank sees the same whole batch;
3. the unchanged MoE layer runs on that batch with the T-rank group (its own all-reduce or
   all-to-all completes every row on every rank);
4. each rank keeps its own DP rank's rows.

Lockstep across DP ranks: every forward pass issues the same collectives on every rank, so the
DP ranks must run their forward passes together. Before each scheduler iteration the DP ranks'
leaders agree (one all-reduce over the leaders) whether any of them has work and whether any
is stopping; a DP rank with nothing to run then takes an idle step, a forward of zero tokens
that only joins the MoE collectives; a step that ran no forward pass (a PD poll, an early
flush) is topped up with an idle forward so the counts match. A stop anywhere stops everyone.
A draft head with MoE layers (NEXTN's MTP layer) adds its passes, padded to the same count on
every DP rank: pdcore.engine.parallel.dp_heads.

`--enable-dp-lm-head`: SGLang shards the vocabulary over the attention group so the logits never
cross DP ranks. Here the lm head never spans DP ranks in the first place (each DP rank's first
rank computes its own logits), so the flag is accepted and changes nothing; it needs
`--enable-dp-attention`, as in SGLang.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

from pdcore.config import ServerArgs
from pdcore.engine.model.layers import TPInfo, share_host_threads
from pdcore.engine.parallel.dp_attention_args import attention_size
from pdcore.engine.parallel.dp_gather import DPAttnTPInfo
from pdcore.errors import ConfigError

log = logging.getLogger(__name__)

def join(args: ServerArgs, rank: int, method: str, timeout_s: float) -> DPAttnTPInfo:
    """Join the T-rank group as global `rank`, then every attention group (every rank creates
    every group, in the same order, as torch.distributed requires)."""
    import torch.distributed as dist

    from pdcore.plugins.host import platforms

    platform = platforms().create(args.device)
    backend = platform.dist_backend
    if platform.memory_kind.value == "host":  # this node's ranks of the server share the host
        share_host_threads(args.tp_size // args.nnodes)
    t, a = args.tp_size, attention_size(args)
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=t,
                            timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    cpu_world = group if backend == "gloo" else dist.new_group(backend="gloo")
    world = TPInfo(rank, t, group, cpu_world, args.ep_size)
    mine: tuple[Any, Any] = (None, None)
    if a > 1:
        for d in range(args.dp_size):
            members = list(range(d * a, (d + 1) * a))
            g = dist.new_group(members)
            cg = g if backend == "gloo" else dist.new_group(members, backend="gloo")
            if rank in members:
                mine = (g, cg)
    leaders = (dist.new_group([d * a for d in range(args.dp_size)], backend="gloo") if a > 1
               else cpu_world)
    d = rank // a
    log.info("rank %d/%d joined DP attention: DP rank %d/%d, attention rank %d/%d (%s)", rank, t,
             d, args.dp_size, rank % a, a, backend)
    return DPAttnTPInfo(rank % a, a, mine[0], mine[1], args.ep_size, world=world, dp_rank=d,
                        dp_size=args.dp_size, leaders=leaders, src=d * a)


# ---- lockstep across DP ranks --------------------------------------------------------------------
class DPSync:
    """What the Lockstep needs: the leaders' agreement and idle forwards."""

    def __init__(self, tp: DPAttnTPInfo, model: torch.nn.Module, pads: Any = None) -> None:
        """`pads`: a draft head's MoE passes (NEXTN: pdcore.engine.parallel.dp_heads)."""
        self.tp, self.pads = tp, pads
        from pdcore.engine.model.moe import MoE

        self.moes = [m for m in model.modules() if isinstance(m, MoE) and m.dp is not None]
        if not self.moes:
            raise ConfigError("--enable-dp-attention needs a MoE model (this model has no MoE "
                              "layer); drop the flag")
        self._mark = 0
        self.idle_forwards = 0
        tp.marked[0] = True  # from now on every forward starts at begin() or idle_forward()

    def stats(self) -> dict[str, int]:
        out = {"dp_idle_forwards_total": self.idle_forwards}
        if self.pads is not None:
            out["dp_head_idle_passes_total"] = self.pads.idle_passes
        return out

    def agree(self, run: bool, stop: bool) -> tuple[bool, bool]:
        """(any DP rank runs, any DP rank stops): leaders only."""
        import torch.distributed as dist

        flags = torch.tensor([int(run), int(stop)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.tp.leaders)
        return bool(flags[0]), bool(flags[1])

    def begin(self) -> None:
        self._mark = self.tp.forwards[0]
        self.tp.counts[0] = None
        if self.pads is not None:
            self.pads.begin()

    @torch.inference_mode()
    def idle_forward(self, fresh: bool = True) -> None:
        """Zero tokens through every MoE layer, in model order: only the collectives run (with
        a MoE draft head: its passes around it, padded; `fresh`: a step of its own)."""
        pads = self.pads
        if pads is not None:
            if fresh:
                pads.begin()
            pads.before_forward()
        self.idle_forwards += 1
        self.tp.counts[0] = None
        for m in self.moes:
            m(torch.empty(0, m.gate.shape[1], dtype=m.w13.dtype, device=m.w13.device))
        if pads is not None:
            pads.after_forward_begin()
            pads.after_forward_end()

    def end(self) -> None:
        """After a step: one forward pass, real or idle, whatever the step did."""
        pads = self.pads
        if pads is None and self.tp.forwards[0] == self._mark:
            self.idle_forward()
        elif pads is not None and not pads.forwarded:
            self.idle_forward(fresh=False)  # after the chain passes the step may have run
        ran = self.tp.forwards[0] - self._mark
        want = len(self.moes) + (pads.per_step if pads is not None else 0)
        if ran != want:
            raise RuntimeError(f"DP attention: a step ran {ran} MoE layers, expected "
                               f"{want}; the DP ranks' collectives no longer match")


def sync_for(tp: TPInfo, sched: Any) -> DPSync | None:
    """The DP lockstep of a scheduler (its runtime surface, engine/sched/runtime_api.py) whose
    group is a DP attention group, else None."""
    if not isinstance(tp, DPAttnTPInfo):
        return None
    return DPSync(tp, sched.model, sched.draft_dp_pads)
