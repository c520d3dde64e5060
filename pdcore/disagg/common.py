"""Pieces both KV managers share: counters, advertised host, backend and planner set-up."""

from __future__ import annotations

import socket
import threading
from collections import Counter

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.interfaces.planner import TransferPlanner
from pdcore.interfaces.transfer import BackendContext, TransferEngine
from pdcore.route_auth import WARMUP_HOST

FAKE_BOOTSTRAP_HOST = WARMUP_HOST  # SGLang's warm-up / health_generate host: no transfer at all
UNBOUNDED_PAGES = 1 << 30  # dest_page_count() of a fake room: any number of pages "fits"


def advertised_host(host: str) -> str:
    """An address peers can reach when we bind `host` (wildcards resolve to this host's IP)."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Counters:
    """Thread-safe named counters for metrics()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def make_backend(name: str, role: str, args: ServerArgs, env: DisaggEnv, tp_rank: int,
                 tp_size: int) -> TransferEngine:
    from pdcore.plugins.host import transfer_backends

    ctx = BackendContext(
        role=role, rank=tp_rank, tp_size=tp_size, device=args.device,
        gpu_id=args.base_gpu_id + tp_rank, host=advertised_host(args.host),
        server_id=args.server_id, ib_device=args.disaggregation_ib_device,
        thread_pool_size=env.thread_pool_size, queue_size=env.queue_size, env=env.raw)
    return transfer_backends().create(name, ctx)


def make_planner(env: DisaggEnv) -> TransferPlanner:
    """The planner chosen by configuration (`staging` when SGLANG_DISAGG_STAGING_BUFFER=1),
    found in the registry like any backend: `default` is the builtin plugin's."""
    from pdcore.plugins.host import transfer_planners

    return transfer_planners().create("staging" if env.staging_buffer else "default")
