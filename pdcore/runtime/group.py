"""The TP process group: joining it (through the platform plugin's torch.distributed backend),
leaving it, and agreeing that every rank started."""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

from pdcore.config import ServerArgs
from pdcore.env import ENV
from pdcore.runtime.topology import local_ranks

if TYPE_CHECKING:  # torch is imported only where a rank actually runs (the CLI stays fast)
    from pdcore.engine.model.layers import TPInfo

log = logging.getLogger(__name__)


def collective_timeout_s() -> float:
    """Bounds every collective (PDCORE_TP_TIMEOUT): a rank that waits longer (a peer stuck
    loading a model) fails instead of hanging. Rank 0 broadcasts at least every idle poll, so a
    live group never idles anywhere near this."""
    return ENV.pdcore_tp_timeout


def join_group(args: ServerArgs, rank: int, method: str) -> TPInfo:
    """Join the TP group as `rank`; TP 1 needs no group at all."""
    from pdcore.engine.model.layers import TPInfo
    from pdcore.engine.parallel import dp_attention_args

    if dp_attention_args.active(args):  # one group over every DP rank's ranks
        from pdcore.engine.parallel import dp_attention

        return dp_attention.join(args, rank, method, collective_timeout_s())
    if args.tp_size == 1:
        return TPInfo()
    import torch.distributed as dist

    from pdcore.plugins.host import platforms

    platform = platforms().create(args.device)
    backend = platform.dist_backend
    if platform.memory_kind.value == "host":
        from pdcore.engine.model.layers import share_host_threads

        share_host_threads(len(local_ranks(args)) * args.dp_size)  # the node's ranks share it
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=args.tp_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s()))
    group = dist.group.WORLD
    # scheduler agreement moves small CPU objects: gloo even when the tensors go over nccl
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo")
    log.info("rank %d/%d joined the TP group (%s) at %s", rank, args.tp_size, backend, method)
    return TPInfo(rank, args.tp_size, group, cpu_group, args.ep_size)


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def agree_started(tp: TPInfo, error: str | None) -> str | None:
    """Every rank's start-up outcome; the first error (with its rank) or None when all ok."""
    errors = tp.all_gather_object(error)
    for rank, err in enumerate(errors):
        if err:
            return f"TP rank {rank}: {err}"
    return None
