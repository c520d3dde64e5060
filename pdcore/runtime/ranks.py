"""TP rank processes: node 0's scheduler process is rank 0 and spawns the other ranks of its node
(`RankGroup`); every other rank runs `run_rank_process`.

1. every rank joins one torch.distributed group (pdcore.runtime.group);
2. every rank builds its engine shard (its attention heads, MLP slice and KV pool of its heads)
   and, in PD modes, its own role extension and KV manager; the ranks then agree that all of
   them started (`agree_started`: one failed rank fails the start-up with its error everywhere);
3. the other ranks follow rank 0 in lockstep (pdcore.runtime.lockstep);
4. a stop header ends every rank; the death of a rank breaks the group's sockets, so the other
   ranks' collectives fail and they exit too (a server never runs with a missing shard); a rank
   also dies with its parent (pdcore.runtime.lifeline).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdcore.config import ServerArgs
from pdcore.runtime.group import agree_started, join_group, leave_group
from pdcore.runtime.lifeline import no_resource_tracker
from pdcore.runtime.topology import init_method, local_ranks

if TYPE_CHECKING:
    from pdcore.engine.model.layers import TPInfo

log = logging.getLogger(__name__)

CHILD_STOP_S = 10.0


def configure_logging(args: ServerArgs, rank: int) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s")


def run_rank_process(args: ServerArgs, rank: int, method: str) -> None:
    """Entry point of every rank except 0 (spawned): build the shard, then follow rank 0."""
    from pdcore.runtime.lifeline import ParentWatch, die_with_parent

    die_with_parent()
    ParentWatch(lambda: None, f"tp{rank}", grace_s=1.0).start()
    configure_logging(args, rank)
    try:  # rank 0 shows the loading bars; here they are noise (and tqdm's lock would be
        from transformers.utils import logging as hf_logging  # reported leaked at os._exit)

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    tp = join_group(args, rank, method)
    engine, error = None, None
    try:
        from pdcore.engine.build import build_engine
        from pdcore.runtime.roles import attach_role

        engine = build_engine(args, tp)
        attach_role(engine)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it; the group must still agree
        log.error("rank %d failed to start: %s\n%s", rank, e, traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
    failed = True
    try:
        if agree_started(tp, error) is None and engine is not None:
            from pdcore.runtime.lockstep import Lockstep

            failed = False
            step = Lockstep(engine)
            while step.follow():
                pass
    finally:
        if engine is not None:
            engine.close()
        leave_group()
    # everything is closed; skip the interpreter teardown (seconds with torch loaded) so rank 0
    # and the HTTP process see this rank gone at once
    logging.shutdown()
    os._exit(1 if failed else 0)


def start_spawned(target: Any, jobs: dict[str, tuple], daemon: bool = True
                  ) -> list[multiprocessing.process.BaseProcess]:
    """One spawned process per job (name -> target's arguments), started in order."""
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=target, args=a, name=n, daemon=daemon) for n, a in jobs.items()]
    no_resource_tracker()
    for p in procs:
        p.start()
    return procs


def spawn_ranks(args: ServerArgs, method: str, ranks: range | list[int]
                ) -> list[multiprocessing.process.BaseProcess]:
    return start_spawned(run_rank_process,
                         {f"pdserve-tp{rank}": (args, rank, method) for rank in ranks})


class RankGroup:
    """Node 0's view: rank 0 (this process) plus the rank processes it spawned."""

    def __init__(self, args: ServerArgs) -> None:
        from pdcore.engine.model.layers import TPInfo

        self.args = args
        self.children: list[multiprocessing.process.BaseProcess] = []
        self.tp = TPInfo()
        self.method = ""  # where the ranks met; a file store is removed at close

    def start(self) -> TPInfo:
        """Spawn ranks 1..k-1 of node 0 and join the group as rank 0."""
        if self.args.tp_size == 1:
            return self.tp
        from pdcore.engine.parallel.dp_attention_args import active, replica_ranks

        if active(self.args):  # this DP rank's ranks

            ranks = list(replica_ranks(self.args))
            self.method = self.args.dp_attention_init
            self.children = spawn_ranks(self.args, self.method, ranks[1:])
            self.tp = join_group(self.args, ranks[0], self.method)
            return self.tp
        self.method = init_method(self.args)
        self.children = spawn_ranks(self.args, self.method,
                                    [r for r in local_ranks(self.args) if r != 0])
        self.tp = join_group(self.args, 0, self.method)
        return self.tp

    def close(self) -> None:
        """After the stop header: let the ranks finish, then make sure they are gone."""
        deadline = time.monotonic() + CHILD_STOP_S
        for p in self.children:
            p.join(max(0.1, deadline - time.monotonic()))
        terminate(self.children)
        if self.tp.size > 1 or getattr(self.tp, "world", None) is not None:
            leave_group()
        if self.method.startswith("file://"):  # left behind when a rank died before leaving
            Path(self.method.removeprefix("file://")).unlink(missing_ok=True)


def terminate(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
