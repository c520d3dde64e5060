"""Builds a PD role's scheduling extension: the aux rows, the KV manager over the engine's KV
pool, and the prefill or decode extension (pdcore.disagg.prefill.sched / decode.sched). The
runtime (pdcore.runtime.roles) installs it into the scheduler."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.disagg.aux import AuxBuffers, ChainGeometry
from pdcore.engine.kv.cache import KVCache
from pdcore.engine.model.fingerprint import draft_identity
from pdcore.engine.sched.api import SchedulerAPI
from pdcore.engine.sched.extension import Extension
from pdcore.engine.sched.scheduler import Scheduler
from pdcore.env import environ

log = logging.getLogger(__name__)


def _host_pool(args: ServerArgs, kv: KVCache) -> Any:
    """Aux rows live in host memory: the KV pool when it is on the host, else a torch pool."""
    if kv.layers[0][0].device.type == "cpu":
        return kv.pool
    from pdcore.interfaces.memory import PoolContext
    from pdcore.plugins.host import memory_pools

    return memory_pools().create("torch", PoolContext(server_id=args.server_id, device="cpu",
                                                      env=environ()))


def make_extension(args: ServerArgs, kv: KVCache, sched: Scheduler
                   ) -> tuple[Extension, dict[str, Any]]:
    """The started extension of `args.disaggregation_mode` and what it adds to the server info.
    The KV the manager moves is the target's and, with a draft head (EAGLE, NEXTN), the head's one
    layer after it (KVCache.transfer_layers; the layout's `draft_layers`), and the aux rows carry
    the head's chain start, D's first drafts (disagg/aux.py)."""
    env = DisaggEnv.from_env()
    api = SchedulerAPI(sched)
    geo = api.chain_geometry()  # a draft head's chain start rides in the row
    aux = AuxBuffers(_host_pool(args, kv), num_slots=max(64, 4 * args.max_running_requests),
                     chain=(ChainGeometry(*geo, head=draft_identity(args)) if geo is not None
                            else None))
    layout, regions = kv.layout(), kv.regions()
    from pdcore.plugins.default_backend import resolve_transfer_backend

    backend = resolve_transfer_backend(args)
    tp = api.tp_group  # every TP rank runs its own manager for the heads it holds
    if args.disaggregation_mode == "prefill":
        from pdcore.disagg.prefill import PrefillKVManager
        from pdcore.disagg.prefill.sched import PrefillExtension

        # rank 0 draws the route secret; the TP group (every node) is the only one to learn it;
        # --dp-size > 1: the HTTP process drew one for all its replicas, which rank 0 passes on
        # (a replica's ranks on another node never saw the HTTP process's arguments)
        secret = tp.broadcast_object(args.pd_route_secret or secrets.token_hex(16))
        mgr = PrefillKVManager(args, env, layout, regions, aux, backend,
                               tp_rank=tp.rank, tp_size=tp.size, kv_tensors=kv.transfer_layers,
                               pool=kv.pool, route_secret=secret)
        ext: Extension = PrefillExtension(sched, mgr, aux)
    else:
        from pdcore.disagg.decode import DecodeKVManager
        from pdcore.disagg.decode.sched import DecodeExtension

        mgr = DecodeKVManager(args, env, layout, regions, aux, backend,
                              tp_rank=tp.rank, tp_size=tp.size, kv_tensors=kv.transfer_layers,
                              pool=kv.pool)
        ext = DecodeExtension(sched, mgr, aux, args)
    mgr.start()
    log.info("%s mode with transfer backend %r", args.disaggregation_mode, backend)
    return ext, {"disaggregation_transfer_backend": backend,
                 "bootstrap_addr": getattr(mgr, "bootstrap_addr", None)}
