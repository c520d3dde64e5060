"""pdcore entry point `ascend`: the platform `npu`, the memory pool `npu` and the transfer
backend `ascend`. Imports only stdlib and pdcore (plus pd_ascend's pure settings module):
torch-npu, memfabric-hybrid and pd-mooncake are imported inside factories and probes, so a
machine without them still lists every component, with the reason it cannot run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from pdcore.env import environ
from pdcore.plugins import hookimpl
from pdcore.plugins.lazy import lazy

MF_INSTALL = "pip install memfabric-hybrid"


def npu_availability() -> tuple[bool, str]:
    from pd_ascend import npu_runtime

    return npu_runtime.availability()


def _mooncake_availability() -> tuple[bool, str]:
    if importlib.util.find_spec("pd_mooncake") is None:
        return False, ("ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE=true but the pd-mooncake plugin is "
                       "not installed; pip install ./plugins/pd-mooncake "
                       "mooncake-transfer-engine-npu (needs Ascend CANN)")
    return True, ""


def memfabric_availability() -> tuple[bool, str]:
    """memfabric-hybrid installed, and the Ascend driver it checks for present."""
    from pd_ascend.settings import DRIVER_FILES, ascend_driver_file

    if importlib.util.find_spec("memfabric_hybrid") is None:
        return False, f"memfabric-hybrid is not installed; {MF_INSTALL}"
    if ascend_driver_file() is None:
        looked = " or ".join(str(p) for p in DRIVER_FILES)
        return False, ("memfabric-hybrid needs the Ascend NPU driver, which is not installed here "
                       f"(no {looked}; memfabric reads the driver version from it and refuses to "
                       "start its transfer engine without it)")
    return True, ""


def backend_availability() -> tuple[bool, str]:
    """Which implementation backend `ascend` would use, and whether it can run here.

    The switch is read from this process's environment: the server passes the same environment
    to the factory."""
    from pd_ascend.settings import use_mooncake

    try:
        mooncake = use_mooncake(environ())
    except Exception as e:  # noqa: BLE001 - a bad value is a reason here; the factory raises
        return False, str(e)
    return _mooncake_availability() if mooncake else memfabric_availability()


def create_backend(ctx: Any) -> Any:
    from pd_ascend.settings import use_mooncake

    if use_mooncake(ctx.env or {}):
        from pd_ascend import mooncake_ascend

        return mooncake_ascend.create(ctx)
    from pd_ascend import memfabric_engine

    return memfabric_engine.create(ctx)


@hookimpl
def pd_register_platforms(register: Callable[..., None]) -> None:
    register("npu", lazy("pd_ascend.platform:NpuPlatform"),
             description="Ascend NPUs via torch-npu; device npu:{base_gpu_id + rank}; hccl",
             availability=npu_availability, reads=("base_gpu_id",))


@hookimpl
def pd_register_memory_pools(register: Callable[..., None]) -> None:
    register("npu", lazy("pd_ascend.pool:make_npu_pool"),
             description="KV buffers in NPU memory (aux rows stay in host memory)",
             availability=npu_availability)


@hookimpl
def pd_register_transfer_backends(register: Callable[..., None]) -> None:
    register("ascend", create_backend,
             description=("Ascend NPU KV transfer over memfabric-hybrid (ASCEND_MF_STORE_URL, "
                          "ASCEND_MF_TRANSFER_PROTOCOL sdma|device_rdma), or Mooncake's Ascend "
                          "transport with ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE=true"),
             availability=backend_availability)
