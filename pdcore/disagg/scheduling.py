"""Wires a PD mode into the scheduler: builds the aux rows and the KV manager, then installs the
prefill or decode extension (pdcore.disagg.prefill_sched / decode_sched)."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from pdcore.config import DisaggEnv
from pdcore.disagg.aux import AuxBuffers

log = logging.getLogger(__name__)


def _host_pool(engine: Any) -> Any:
    """Aux rows live in host memory: the KV pool when it is on the host, else a torch pool."""
    if engine.kv.layers[0][0].device.type == "cpu":
        return engine.kv.pool
    import os

    from pdcore.interfaces.memory import PoolContext
    from pdcore.plugins.host import memory_pools

    return memory_pools().create("torch", PoolContext(server_id=engine.args.server_id,
                                                      device="cpu", env=dict(os.environ)))


def attach(engine: Any) -> None:
    args = engine.args
    env = DisaggEnv.from_env()
    aux = AuxBuffers(_host_pool(engine), num_slots=max(64, 4 * args.max_running_requests))
    layout, regions = engine.kv.layout(), engine.kv.regions()
    from pdcore.plugins.default_backend import resolve_transfer_backend

    backend = resolve_transfer_backend(args)
    tp = engine.scheduler.tp  # every TP rank runs its own manager for the heads it holds
    if args.disaggregation_mode == "prefill":
        from pdcore.disagg.prefill import PrefillKVManager
        from pdcore.disagg.prefill_sched import PrefillExtension

        # rank 0 draws the route secret; the TP group (every node) is the only one to learn it
        secret = tp.broadcast_object(secrets.token_hex(16))
        mgr = PrefillKVManager(args, env, layout, regions, aux, backend, tp.rank, tp.size,
                               engine.kv.layers, engine.kv.pool, route_secret=secret)
        ext: Any = PrefillExtension(engine.scheduler, mgr, aux)
    else:
        from pdcore.disagg.decode import DecodeKVManager
        from pdcore.disagg.decode_sched import DecodeExtension

        mgr = DecodeKVManager(args, env, layout, regions, aux, backend, tp.rank, tp.size,
                              engine.kv.layers, engine.kv.pool)
        ext = DecodeExtension(engine.scheduler, mgr, aux, args)
    mgr.start()
    engine.scheduler.ext = ext
    engine.info["disaggregation_transfer_backend"] = backend
    engine.info["bootstrap_addr"] = getattr(mgr, "bootstrap_addr", None)
    log.info("%s mode with transfer backend %r", args.disaggregation_mode, backend)
