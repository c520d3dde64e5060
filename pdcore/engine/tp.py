"""Tensor parallelism across processes: rank processes, their torch.distributed group, and the
lockstep that keeps every rank's scheduler identical.

1. node 0's scheduler process is rank 0: it spawns the other ranks of its node; on another node
   `pdserve serve --nnodes N --node-rank R` spawns that node's ranks and serves no HTTP
   (`run_node`). Every rank joins one torch.distributed group through its platform plugin's
   backend (gloo on cpu) at `--dist-init-addr`, or at a free loopback port on a single node;
2. every rank builds its engine shard (its attention heads, MLP slice and KV pool of its heads)
   and, in PD modes, its own KV manager; the ranks then agree that all of them started
   (`agree_started`: one failed rank fails the start-up with its error everywhere);
3. rank 0 talks to the HTTP process; each loop it broadcasts a StepHeader (new requests, aborts,
   whether to step, its clock) and every rank applies it and runs the same step (`Lockstep`).
   Inside a step rank 0 samples and broadcasts the tokens (model_runner) and the PD extensions
   agree on poll states by MIN (pdcore.disagg.agree), so the schedules never diverge;
4. a stop header ends every rank; the death of a rank breaks the group's sockets, so the other
   ranks' collectives fail and they exit too (a server never runs with a missing shard); a rank
   also dies with its parent (pdcore.engine.lifeline);
5. a request that fails inside a step fails alone (model_runner reports it to every rank). An
   unexpected error out of a step with TP 1 fails the request it names (a TransferError's room)
   or else every in-flight request, and the engine keeps serving; with TP > 1 it is fatal,
   since the ranks could no longer be known to agree.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdcore.config import ServerArgs
from pdcore.engine.io_struct import AbortReq, GenerateReq, TokenOut
from pdcore.errors import ConfigError

if TYPE_CHECKING:  # torch is imported only where a rank actually runs (the CLI stays fast)
    from pdcore.engine.models.layers import TPInfo

log = logging.getLogger(__name__)

# Bounds every collective: a rank that waits longer (a peer stuck loading a model) fails
# instead of hanging. Rank 0 broadcasts at least every idle poll, so a live group never idles
# anywhere near this.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("PDCORE_TP_TIMEOUT", "600"))
CHILD_STOP_S = 10.0


def check_parallel_args(args: ServerArgs) -> None:
    """What --tp-size / --nnodes / --node-rank / --dist-init-addr / --dp-size must satisfy."""
    if args.dp_size > 1:
        raise ConfigError("--dp-size > 1 (data-parallel replicas behind one server) is not "
                          "supported yet; start one server per replica and put the router in "
                          "front of them")
    if args.tp_size % args.nnodes:
        raise ConfigError(f"--tp-size {args.tp_size} must be a multiple of --nnodes "
                          f"{args.nnodes} (every node runs the same number of ranks)")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, "
                          "where the ranks meet); give every node the same value")
    if args.dist_init_addr:
        _split_addr(args.dist_init_addr)


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def local_ranks(args: ServerArgs) -> range:
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def init_method(args: ServerArgs) -> str:
    if args.dist_init_addr:
        host, port = _split_addr(args.dist_init_addr)
        return f"tcp://{host}:{port}"
    with socket.socket() as s:  # one node: any free loopback port, passed to the children
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join_group(args: ServerArgs, rank: int, method: str) -> TPInfo:
    """Join the TP group as `rank`; TP 1 needs no group at all."""
    from pdcore.engine.models.layers import TPInfo

    if args.tp_size == 1:
        return TPInfo()
    import torch.distributed as dist

    from pdcore.plugins.host import platforms

    platform = platforms().create(args.device)
    backend = platform.dist_backend
    if platform.memory_kind.value == "host":
        # the ranks of a node share its cores: oversubscribed intra-op threads spin against
        # each other and the collectives (a step gets several times slower, not faster)
        import torch

        per_rank = max(1, (os.cpu_count() or 1) // len(local_ranks(args)))
        torch.set_num_threads(min(torch.get_num_threads(), per_rank))
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=args.tp_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    group = dist.group.WORLD
    # scheduler agreement moves small CPU objects: gloo even when the tensors go over nccl
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo")
    log.info("rank %d/%d joined the TP group (%s) at %s", rank, args.tp_size, backend, method)
    return TPInfo(rank, args.tp_size, group, cpu_group)


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


def attach_extension(engine: Any) -> None:
    if engine.args.disaggregation_mode == "null":
        return
    from pdcore.disagg.scheduling import attach

    attach(engine)


@dataclass
class StepHeader:
    """What rank 0 tells the other ranks before each loop iteration."""

    msgs: list[Any] = field(default_factory=list)  # GenerateReq / AbortReq, in arrival order
    run: bool = False  # run one scheduler step after applying msgs
    stop: bool = False
    now: float = 0.0  # rank 0's monotonic clock: time-based decisions must agree


class Lockstep:
    """Drives one scheduler identically on every rank (rank 0 leads, the others follow)."""

    def __init__(self, engine: Any) -> None:
        self.sched = engine.scheduler
        self.tp: TPInfo = self.sched.tp

    def _apply(self, msgs: list[Any]) -> None:
        from pdcore.engine.request import Req

        for m in msgs:
            try:
                if isinstance(m, GenerateReq):
                    self.sched.add(Req.from_generate(m))
                elif isinstance(m, AbortReq):
                    self.sched.abort(m.rid, m.reason)
            except Exception as e:
                # every rank applies the same messages, so every rank takes this branch alike
                log.exception("request %s could not be admitted", m.rid)
                req = self.sched.reqs.get(m.rid)
                if req is None:
                    self.sched.outbox.append(TokenOut(
                        m.rid, [], finished=True, error=f"{type(e).__name__}: {e}",
                        error_status=500, finish_reason={"type": "abort", "message": str(e)}))
                else:
                    self._contain_one(req, e)

    def lead(self, msgs: list[Any], stop: bool = False) -> list[TokenOut]:
        """Rank 0: apply msgs, tell the others, step if there is work; returns the outputs."""
        self._apply(msgs)
        run = not stop and self.sched.has_work()
        now = time.monotonic()
        if self.tp.size > 1:
            self.tp.broadcast_object(StepHeader(msgs, run, stop, now))
        self.sched.step_time = now
        if not run:
            return []
        try:
            return self.sched.step()
        except Exception as e:
            if self.tp.size > 1:
                log.critical("scheduler step failed with TP %d; the ranks may disagree now, "
                             "so the engine stops", self.tp.size)
                raise
            return self._contain(e)

    def _contain(self, e: Exception) -> list[TokenOut]:
        """Fail the requests an unexpected step error concerns; the loop goes on."""
        from pdcore.engine.request import Phase

        live = [r for r in self.sched.reqs.values() if r.phase is not Phase.FINISHED]
        room = getattr(e, "room", None)
        named = [r for r in live if room is not None and getattr(r.disagg, "room", None) == room]
        victims = named or live
        log.exception("scheduler step failed (%s); failing %d request(s), the engine goes on",
                      f"room {room}" if named else "not attributable to one request",
                      len(victims))
        for req in victims:
            self._contain_one(req, e)
        return self.sched._collect_all()

    def _contain_one(self, req: Any, e: Exception) -> None:
        why = f"internal error while serving this request: {type(e).__name__}: {e}"
        try:
            self.sched.fail(req, why, 500)
        except Exception:
            log.exception("failing request %s raised; dropping it", req.rid)
            req.error, req.error_status = why, 500
            req.finish_reason = {"type": "abort", "message": why}
            if req.phase.value != "finished":
                self.sched.drop(req)

    def follow(self) -> bool:
        """Other ranks: one iteration as rank 0 decided; False once told to stop."""
        head: StepHeader = self.tp.broadcast_object(None)
        self._apply(head.msgs)
        if head.stop:
            return False
        if head.run:
            self.sched.step_time = head.now
            self.sched.step()  # outputs are rank 0's business
        return True


def _configure_logging(args: ServerArgs, rank: int) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s")


def run_rank_process(args: ServerArgs, rank: int, method: str) -> None:
    """Entry point of every rank except 0 (spawned): build the shard, then follow rank 0."""
    from pdcore.engine.lifeline import ParentWatch, die_with_parent

    die_with_parent()
    ParentWatch(lambda: None, f"tp{rank}", grace_s=1.0).start()
    _configure_logging(args, rank)
    try:  # rank 0 shows the loading bars; here they are noise (and tqdm's lock would be
        from transformers.utils import logging as hf_logging  # reported leaked at os._exit)

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    tp = join_group(args, rank, method)
    engine, error = None, None
    try:
        from pdcore.engine.llm_engine import build_engine

        engine = build_engine(args, tp)
        attach_extension(engine)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it; the group must still agree
        log.error("rank %d failed to start: %s\n%s", rank, e, traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
    failed = True
    try:
        if agree_started(tp, error) is None and engine is not None:
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


class RankGroup:
    """Node 0's view: rank 0 (this process) plus the rank processes it spawned."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        from pdcore.engine.models.layers import TPInfo

        self.children: list[multiprocessing.process.BaseProcess] = []
        self.tp = TPInfo()

    def start(self) -> TPInfo:
        """Spawn ranks 1..k-1 of node 0 and join the group as rank 0."""
        if self.args.tp_size == 1:
            return self.tp
        method = init_method(self.args)
        mp = multiprocessing.get_context("spawn")
        for rank in local_ranks(self.args):
            if rank == 0:
                continue
            p = mp.Process(target=run_rank_process, args=(self.args, rank, method),
                           name=f"pdserve-tp{rank}", daemon=True)
            p.start()
            self.children.append(p)
        self.tp = join_group(self.args, 0, method)
        return self.tp

    def dead_children(self) -> list[str]:
        return [f"{p.name} (exit code {p.exitcode})" for p in self.children if not p.is_alive()]

    def close(self) -> None:
        """After the stop header: let the ranks finish, then make sure they are gone."""
        deadline = time.monotonic() + CHILD_STOP_S
        for p in self.children:
            p.join(max(0.1, deadline - time.monotonic()))
        _terminate(self.children)
        if self.tp.size > 1:
            leave_group()


def _terminate(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_node(args: ServerArgs) -> int:
    """`pdserve serve --node-rank R` (R > 0): run this node's ranks until rank 0 stops them."""
    _configure_logging(args, local_ranks(args)[0])
    method = init_method(args)
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=run_rank_process, args=(args, rank, method),
                        name=f"pdserve-tp{rank}", daemon=True) for rank in local_ranks(args)]
    for p in procs:
        p.start()
    print(f"pdserve: node {args.node_rank}/{args.nnodes} runs TP ranks "
          f"{local_ranks(args).start}..{local_ranks(args).stop - 1}, joining {method}", flush=True)
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
        _terminate(procs)
    codes = [p.exitcode for p in procs]
    return 0 if stopping["flag"] or all(c == 0 for c in codes) else 1
