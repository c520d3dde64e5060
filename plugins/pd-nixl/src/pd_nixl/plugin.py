"""pdcore entry point `nixl`: registers the `nixl` transfer backend. Imports only stdlib and
pdcore; the SDK is imported inside the factory and the availability probe (through
pd_nixl.engine), so a missing SDK never breaks other plugins.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from pdcore.plugins import hookimpl

INSTALL_HINT = "pip install nixl (pd-nixl depends on it; pin your torch: pip install torch==<yours> nixl)"


@functools.lru_cache(maxsize=1)
def sdk_availability() -> tuple[bool, str]:
    """(True, "") when the nixl SDK imports, else (False, why and what to do)."""
    try:
        importlib.import_module("pd_nixl.engine")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13", "nixl_rocm"):
            return False, f"nixl is not installed: {INSTALL_HINT}"
        return False, f"pd_nixl.engine failed to import: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - a broken SDK must not break the host
        return False, f"nixl failed to import ({type(e).__name__}: {e}); reinstall: {INSTALL_HINT}"
    return True, ""


def _create_backend(ctx: Any) -> Any:
    ok, reason = sdk_availability()
    if not ok:
        from pdcore.errors import UnavailableError

        raise UnavailableError(f"transfer backend 'nixl' is not available here: {reason}")
    from pd_nixl import engine

    return engine.create(ctx)


@hookimpl
def pd_register_transfer_backends(register: Callable[..., None]) -> None:
    register(
        "nixl",
        _create_backend,
        description=("NVIDIA NIXL; plugin from SGLANG_DISAGGREGATION_NIXL_BACKEND (UCX default, "
                     "LIBFABRIC, ...), params from SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"),
        availability=sdk_availability,
    )
