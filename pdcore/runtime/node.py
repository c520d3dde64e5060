"""`pdserve serve --nnodes N --node-rank R` (R > 0): this node runs its TP ranks and serves no
HTTP; rank 0 on node 0 leads them. With `--enable-dp-attention --dp-size D` this node's ranks are
whole DP ranks: one scheduler process per DP rank, linked to node 0's HTTP process
(pdcore.runtime.dp.nodes), each spawning its DP rank's other ranks."""

from __future__ import annotations

import dataclasses
import multiprocessing
import signal
import time
from typing import Any

from pdcore.config import ServerArgs
from pdcore.runtime.dp.nodes import multi_node, node_dp_ranks, run_remote_scheduler
from pdcore.runtime.ranks import configure_logging, spawn_ranks, start_spawned, terminate
from pdcore.runtime.topology import init_method, local_ranks


def run_node(args: ServerArgs) -> int:
    """Run this node's ranks until rank 0 stops them; 1 when one of them failed."""
    ranks = local_ranks(args)
    configure_logging(args, ranks[0])
    method = init_method(args)
    if multi_node(args):
        dp_ranks = node_dp_ranks(args, args.node_rank)
        procs = _spawn_dp_schedulers(args, dp_ranks)
        print(f"pdserve: node {args.node_rank}/{args.nnodes} runs TP ranks "
              f"{ranks.start}..{ranks.stop - 1} as DP attention ranks "
              f"{dp_ranks[0]}..{dp_ranks[-1]}, joining {method}", flush=True)
    elif args.dp_size > 1:  # plain DP: this node's ranks of every replica's TP group
        procs = []
        for r in range(args.dp_size):
            mine = dataclasses.replace(args, dp_rank=r,
                                       base_gpu_id=args.base_gpu_id + r * len(ranks))
            procs += spawn_ranks(mine, init_method(mine), ranks)
        print(f"pdserve: node {args.node_rank}/{args.nnodes} runs TP ranks "
              f"{ranks.start}..{ranks.stop - 1} of each of {args.dp_size} DP replicas, joining "
              f"{method} onwards", flush=True)
    else:
        procs = spawn_ranks(args, method, ranks)
        print(f"pdserve: node {args.node_rank}/{args.nnodes} runs TP ranks "
              f"{ranks.start}..{ranks.stop - 1}, joining {method}", flush=True)
    stopping = {"flag": False}

    def _term(*_: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    try:
        while not stopping["flag"] and any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank died: the group is broken, take the others down too
            time.sleep(0.2)
    finally:
        terminate(procs)
    codes = [p.exitcode for p in procs]
    return 0 if stopping["flag"] or all(c == 0 for c in codes) else 1


# a DP rank's scheduler waits this long for node 0 (which may still be loading its own DP ranks)
LINK_TIMEOUT_S = 900.0


def _spawn_dp_schedulers(args: ServerArgs, dp_ranks: list[int]
                         ) -> list[multiprocessing.process.BaseProcess]:
    # not daemons: each spawns its DP rank's other ranks; terminate() stops them
    return start_spawned(run_remote_scheduler,
                         {f"pdserve-dp{d}": (args, d, LINK_TIMEOUT_S) for d in dp_ranks},
                         daemon=False)
