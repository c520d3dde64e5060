"""pdcore entry point `mooncake`: registers the `mooncake` transfer backend and Mooncake's CUDA
memory pools. Imports only stdlib and pdcore; the SDK is imported inside factories and
availability probes (through pd_mooncake.engine), so a missing SDK never breaks other plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcore.plugins import hookimpl
from pdcore.plugins.lazy import guarded, sdk_probe

INSTALL_HINT = ("pip install mooncake-transfer-engine on GPU machines (pd-mooncake's [cuda] "
                "extra) or mooncake-transfer-engine-non-cuda on CPU-only machines ([cpu])")
SYSTEM_LIBS_HINT = "apt-get install -y libibverbs1 librdmacm1 libnuma1 ibverbs-providers"

# memory-pool name -> SGLANG_MOONCAKE_CUSTOM_MEM_POOL value it serves
POOLS = {
    "mooncake-nvlink": "NVLINK",
    "mooncake-barex": "BAREX",
    "mooncake-intra-node-nvlink": "INTRA_NODE_NVLINK",
}


# (True, "") when the mooncake SDK imports, else (False, why and what to do); cached
sdk_availability = sdk_probe("pd_mooncake.engine", "mooncake-transfer-engine", ("mooncake",),
                             INSTALL_HINT, f"missing system libraries? {SYSTEM_LIBS_HINT}")
_create_backend = guarded("transfer backend", "mooncake", sdk_availability,
                          "pd_mooncake.engine:create")


def _pool_availability(kind: str) -> Callable[[], tuple[bool, str]]:
    def availability() -> tuple[bool, str]:
        ok, reason = sdk_availability()
        if not ok:
            return ok, reason
        from pd_mooncake import engine

        return engine.cuda_pool_support(kind)

    return availability


def _pool_factory(kind: str, name: str) -> Callable[[Any], Any]:
    def create(ctx: Any) -> Any:
        from pd_mooncake import pools

        return pools.MooncakeCudaPool(ctx, kind, name)

    return create


@hookimpl
def pd_register_transfer_backends(register: Callable[..., None]) -> None:
    register(
        "mooncake",
        _create_backend,
        description=("Mooncake transfer engine (P2P handshake; MOONCAKE_PROTOCOL rdma|tcp|efa; "
                     "the transport really in use is logged and exposed as engine.transport)"),
        availability=sdk_availability,
        reads=("disaggregation_ib_device", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL",
               "MOONCAKE_PROTOCOL", "MC_FORCE_TCP"),
    )


@hookimpl
def pd_register_memory_pools(register: Callable[..., None]) -> None:
    for name, kind in POOLS.items():
        register(
            name,
            _pool_factory(kind, name),
            description=f"CUDA KV pool for SGLANG_MOONCAKE_CUSTOM_MEM_POOL={kind}",
            availability=_pool_availability(kind),
        )
