"""`pdserve serve --nnodes N --node-rank R` (R > 0): this node runs its TP ranks and serves no
HTTP; rank 0 on node 0 leads them."""

from __future__ import annotations

import signal
import time
from typing import Any

from pdcore.config import ServerArgs
from pdcore.runtime.ranks import configure_logging, spawn_ranks, terminate
from pdcore.runtime.topology import init_method, local_ranks


def run_node(args: ServerArgs) -> int:
    """Run this node's ranks until rank 0 stops them; 1 when one of them failed."""
    ranks = local_ranks(args)
    configure_logging(args, ranks[0])
    method = init_method(args)
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
