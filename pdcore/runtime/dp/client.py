"""`--dp-size N` (N > 1): N data-parallel replicas behind one HTTP server.

The controller lives in the HTTP process rather than in a process of its own: every
request already passes through the engine handle, so choosing a replica is one function call
(no extra hop, no extra process to supervise), and the per-replica bookkeeping (which replica
holds a request, what is in flight where) is exactly the engine handle's.

`DPEngineClient` has `EngineClient`'s interface and holds one `EngineClient` per replica; each
spawns its own scheduler process (its own KV pool, and `--tp-size` ranks: DP attention is off, as
SGLang means --dp-size without --enable-dp-attention).
1. `start()` starts every replica at once; one failing fails the start-up (the others stop);
2. `generate()` sends a request to its `routed_dp_rank` (`data_parallel_rank`) or to the
   balancer's pick (pdcore.runtime.dp.balance) and remembers where it went, so an abort reaches
   the replica that holds it;
3. `control()` fans out: get_load answers one entry per replica, flush_cache and profiling
   run on every replica; `stats()` merges the replicas' reports (StatsReport.merge);
4. a replica's death ends the server, as the death of the only scheduler does.

In PD mode every replica is its own endpoint of the PD control plane: a prefill server's
replicas all register (DP rank, TP rank) with the one bootstrap server that replica 0 runs,
proving it with one route secret drawn here; decode pulls a room's KV from prefill DP rank
`disagg_prefill_dp_rank`, else `bootstrap_room % prefill dp size` (SGLang's rule). So a prefill
server sends each request to that same replica (`data_parallel_rank`, which both roles receive
in one body, names decode's replica); a decode server's own replica is the request's
`data_parallel_rank` or the balancer's pick (P and D may have different DP sizes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdcore.config import ServerArgs
from pdcore.messages.info import EngineInfo
from pdcore.messages.io import ControlKind, GenerateReq, TokenOut
from pdcore.messages.stats import StatsReport
from pdcore.engine.parallel.dp_attention_args import active as dp_attention_active
from pdcore.engine.parallel.dp_attention_args import new_init_method, replica_args
from pdcore.errors import PDError
from pdcore.runtime.dp.balance import DPBalancer
from pdcore.runtime.dp.nodes import leader_node
from pdcore.runtime.dp.remote import RemoteEngineClient
from pdcore.runtime.handle import EngineClient, EngineError, EngineState
from pdcore.runtime.stats import merge_transfer_stats
from pdcore.runtime.topology import init_method

log = logging.getLogger(__name__)

# a replica's state decides the server's in this order (any dead replica: the server is dead)
_STATE_ORDER = (EngineState.DEAD, EngineState.FAILED, EngineState.STARTING, EngineState.STOPPED,
                EngineState.READY)


class DPEngineClient:
    def __init__(self, args: ServerArgs, *, tokenizer: Any = None, **kwargs: Any) -> None:
        self.args = args
        # replica r runs on accelerators base + r * (its ranks on this node) onwards (SGLang's)
        secret = secrets.token_hex(16) if args.disaggregation_mode == "prefill" else ""
        per_node = args.tp_size // args.nnodes
        self.replicas = [EngineClient(dataclasses.replace(
            args, base_gpu_id=args.base_gpu_id + rank * per_node, dp_rank=rank,
            pd_route_secret=secret), tokenizer=tokenizer, **kwargs)
            for rank in range(args.dp_size)]
        if dp_attention_active(args):  # one rank group over all DP ranks: a shared meeting point
            init = init_method(args) if args.dist_init_addr else new_init_method()
            for rank, c in enumerate(self.replicas):
                c.args = replica_args(c.args, rank, init, args.base_gpu_id)
            if args.nnodes > 1:  # DP ranks of the other nodes: reached over their links
                self.replicas = [RemoteEngineClient(c.args, tokenizer=tokenizer, **kwargs)
                                 if leader_node(args, rank) else c
                                 for rank, c in enumerate(self.replicas)]
        self.balancer = DPBalancer(args.dp_size, args.load_balance_method)
        self._where: dict[str, int] = {}  # rid -> replica holding it
        self._dead = False
        self.on_dead: Callable[[str], None] | None = None
        for rank, c in enumerate(self.replicas):
            c.on_dead = lambda msg, rank=rank: self._replica_dead(rank, msg)

    # ---- state -----------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        states = {c.state for c in self.replicas}
        return next(s for s in _STATE_ORDER if s in states)

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def error(self) -> str:
        for rank, c in enumerate(self.replicas):
            if c.error:
                return f"DP rank {rank}: {c.error}"
        return ""

    @property
    def info(self) -> EngineInfo:
        return self.replicas[0].info

    @property
    def tokenizer(self) -> Any:
        return self.replicas[0].tokenizer

    @property
    def pid(self) -> int | None:
        return self.replicas[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.replicas]

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.replicas[0].tokenizer is None:  # once, before the replicas start: transformers'
            from pdcore.engine.model.tokenizer import load_tokenizer  # lazy imports race in threads

            try:
                tok = await asyncio.to_thread(load_tokenizer, self.args, True)
            except PDError as e:  # the start fails with the reason (never a silent hang)
                for c in self.replicas:
                    c.state, c.error = EngineState.FAILED, str(e)
                raise EngineError(str(e), 503) from e
            for c in self.replicas:
                c.tokenizer = tok
        results = await asyncio.gather(*(c.start() for c in self.replicas),
                                       return_exceptions=True)
        errors = [(r, e) for r, e in enumerate(results) if isinstance(e, BaseException)]
        if not errors:
            log.info("%d DP replicas ready (load balance: %s)", len(self.replicas),
                     self.args.load_balance_method)
            return
        await asyncio.gather(*(c.shutdown() for c in self.replicas), return_exceptions=True)
        rank, err = errors[0]
        if isinstance(err, EngineError):
            raise EngineError(f"DP rank {rank}: {err}", err.status) from err
        raise err

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.replicas), return_exceptions=True)

    def _replica_dead(self, rank: int, message: str) -> None:
        if self._dead:
            return
        self._dead = True
        message = f"DP rank {rank}: {message}"
        for c in self.replicas:  # the server goes down: nothing in flight anywhere will finish
            c._fail_pending(message, 503)
        if self.on_dead is not None:
            self.on_dead(message)

    # ---- requests --------------------------------------------------------------------------
    def require_ready(self) -> None:
        for c in self.replicas:
            c.require_ready()

    def abort(self, rid: str, reason: str = "aborted") -> None:
        rank = self._where.get(rid)
        if rank is not None:
            self.replicas[rank].abort(rid, reason)

    def _rank_for(self, req: GenerateReq) -> int:
        field, rank = "data_parallel_rank", req.routed_dp_rank
        if self.args.disaggregation_mode == "prefill":
            # the replica decode pulls from, which decode computes the same way; a
            # data_parallel_rank here would be decode's rank (both get one body), so it pins
            # prefill only for a request without a room
            route = req.route
            if route is not None and route.prefill_dp_rank is not None:
                field, rank = "disagg_prefill_dp_rank", route.prefill_dp_rank
            elif route is not None and route.room is not None:
                rank = route.room % len(self.replicas)
        if rank is None:
            return self.balancer.pick()
        if not 0 <= rank < len(self.replicas):
            raise EngineError(f"{field} must be in [0, {len(self.replicas)}), got {rank}", 400)
        return rank

    async def generate(self, req: GenerateReq, timeout: float | None = None
                       ) -> AsyncIterator[TokenOut]:
        self.require_ready()
        if req.rid in self._where:
            raise EngineError(f"rid {req.rid!r} is already in flight; use a unique rid", 400)
        fork_of = req.route.fork_of if req.route is not None else None
        # a parallel sample went in sample 0's message, to sample 0's replica
        rank = self._where.get(fork_of, 0) if fork_of is not None else self._rank_for(req)
        tokens = len(req.input_ids) + int(req.sampling.max_new_tokens or 0)
        self._where[req.rid] = rank
        self.balancer.start(rank, tokens)
        try:
            async with contextlib.aclosing(self.replicas[rank].generate(req, timeout)) as outs:
                async for out in outs:
                    yield out
        finally:
            self._where.pop(req.rid, None)
            self.balancer.finish(rank, tokens)

    async def stats(self, timeout: float = 10.0) -> StatsReport:
        """The replicas' reports merged into one server's (StatsReport.merge)."""
        self.require_ready()
        results = await asyncio.gather(*(c.stats(timeout) for c in self.replicas),
                                       return_exceptions=True)
        return StatsReport.merge(self._answers(results), merge_transfer_stats)

    def _answers(self, results: list[Any]) -> list[Any]:
        for rank, r in enumerate(results):
            if isinstance(r, EngineError):
                raise EngineError(f"DP rank {rank}: {r}", r.status) from r
            if isinstance(r, BaseException):
                raise r
        return results

    async def control(self, kind: ControlKind, args: dict[str, Any] | None = None,
                      timeout: float = 10.0) -> dict[str, Any]:
        self.require_ready()
        results = await asyncio.gather(*(c.control(kind, args, timeout) for c in self.replicas),
                                       return_exceptions=True)
        datas: list[dict[str, Any]] = [dict(r) for r in self._answers(results)]
        if kind == ControlKind.GET_LOAD:
            return {"loads": [{**d, "dp_rank": rank} for rank, d in enumerate(datas)]}
        if kind == ControlKind.FLUSH_CACHE:
            return {"flushed": all(bool(d.get("flushed")) for d in datas), "dp_ranks": datas}
        return {**datas[0], "dp_ranks": datas}

