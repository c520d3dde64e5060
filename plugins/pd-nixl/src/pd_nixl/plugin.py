"""pdcore entry point `nixl`: registers the `nixl` transfer backend. Imports only stdlib and
pdcore; the SDK is imported inside the factory and the availability probe (through
pd_nixl.engine), so a missing SDK never breaks other plugins.
"""

from __future__ import annotations

from collections.abc import Callable

from pd_nixl.settings import BACKEND_ENV, PARAMS_ENV
from pdcore.plugins import hookimpl
from pdcore.plugins.lazy import guarded, sdk_probe

INSTALL_HINT = "pip install nixl (pd-nixl depends on it; pin your torch: pip install torch==<yours> nixl)"


# (True, "") when the nixl SDK imports, else (False, why and what to do); cached
sdk_availability = sdk_probe("pd_nixl.engine", "nixl",
                             ("nixl", "nixl_cu12", "nixl_cu13", "nixl_rocm"), INSTALL_HINT,
                             f"reinstall: {INSTALL_HINT}")
_create_backend = guarded("transfer backend", "nixl", sdk_availability, "pd_nixl.engine:create")


@hookimpl
def pd_register_transfer_backends(register: Callable[..., None]) -> None:
    register(
        "nixl",
        _create_backend,
        description=("NVIDIA NIXL; plugin from SGLANG_DISAGGREGATION_NIXL_BACKEND (UCX default, "
                     "LIBFABRIC, ...), params from SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"),
        availability=sdk_availability,
        # what pd_nixl.settings and the engine read: the preflight must not call them ignored
        reads=(BACKEND_ENV, PARAMS_ENV, "NIXL_PLUGIN_DIR"),
    )
