"""Backend `ascend` on Mooncake's Ascend transport (ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE=true).

The only module of pd-ascend that imports pd-mooncake, and only when the switch is on:
1. `pd_mooncake.engine` is imported lazily; a missing pd-mooncake or mooncake SDK, or one that
   fails to load (the NPU wheel needs CANN's libascendcl.so), is a ConfigError saying what to
   install;
2. the installed Mooncake wheel must be the NPU build (mooncake-transfer-engine-npu): the other
   wheels accept protocol "ascend" at initialize() and return 0, yet carry no Ascend transport;
3. the engine is pd-mooncake's MooncakeEngine (its batching, in-flight budget, workers and
   failure reasons), initialized with protocol "ascend" and the local name
   `<ip>:<free port>:npu_<physical id>` that Mooncake's Ascend transport expects
   (ASCEND_NPU_PHY_ID, else the logical NPU id). RDMA device selection does not apply.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import socket
from typing import Any

from pd_ascend.settings import MOONCAKE_VAR, npu_phy_id, session_host
from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.transfer import BackendContext, Capabilities, MemoryKind, TransferEngine

log = logging.getLogger("pd_ascend")

NPU_WHEEL = "mooncake-transfer-engine-npu"
INSTALL = f"pip install ./plugins/pd-mooncake {NPU_WHEEL} (the NPU wheel needs Ascend CANN)"
# Mooncake variables that pick another transport; meaningless with the Ascend one
_IGNORED_ENV = ("MOONCAKE_PROTOCOL", "MC_FORCE_TCP", "MC_FORCE_HCA",
                "SGLANG_MOONCAKE_CUSTOM_MEM_POOL")


def load_engine_module() -> Any:
    """pd_mooncake.engine, or ConfigError naming what is missing."""
    try:
        return importlib.import_module("pd_mooncake.engine")
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing.split(".")[0] == "pd_mooncake":
            what = "the pd-mooncake plugin is not installed"
        elif missing.split(".")[0] == "mooncake":
            what = "pd-mooncake is installed but the mooncake SDK is not"
        else:
            what = f"pd_mooncake.engine failed to import ({type(e).__name__}: {e})"
        raise ConfigError(f"{MOONCAKE_VAR}=true makes backend 'ascend' use Mooncake's Ascend "
                          f"transport, but {what}; {INSTALL}, or unset {MOONCAKE_VAR} to use "
                          f"memfabric-hybrid") from None
    except (ImportError, OSError) as e:
        raise ConfigError(f"{MOONCAKE_VAR}=true: the mooncake SDK failed to load "
                          f"({type(e).__name__}: {e}); the NPU wheel needs CANN (source "
                          f"/usr/local/Ascend/ascend-toolkit/set_env.sh)") from None


def mooncake_wheels() -> list[str]:
    """The distributions that provide the `mooncake` package here."""
    return sorted(importlib.metadata.packages_distributions().get("mooncake", []))


def check_wheel() -> None:
    wheels = mooncake_wheels()
    if NPU_WHEEL not in wheels:
        found = ", ".join(f"{w} {importlib.metadata.version(w)}" for w in wheels) or "none"
        raise ConfigError(
            f"{MOONCAKE_VAR}=true needs Mooncake's Ascend build ({NPU_WHEEL}), but the installed "
            f"Mooncake wheel is: {found}. That wheel accepts protocol 'ascend' without an Ascend "
            f"transport, so nothing would reach the NPU; uninstall it and {INSTALL}")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def engine_class(mce: Any) -> type:
    """pd-mooncake's MooncakeEngine, initialized for the Ascend transport."""

    class MooncakeAscendEngine(mce.MooncakeEngine):  # type: ignore[misc, name-defined]
        name = "ascend"

        def __init__(self, ctx: BackendContext) -> None:  # replaces the base initialization
            env = {k: v for k, v in (ctx.env or {}).items() if k not in _IGNORED_ENV}
            ignored = sorted(set(ctx.env or {}) & set(_IGNORED_ENV))
            if ignored or ctx.ib_device:
                log.warning("%s=true: %s ignored (Mooncake's Ascend transport picks its own "
                            "links); unset them, since the Mooncake library may read some itself",
                            MOONCAKE_VAR, ", ".join(ignored + ["--disaggregation-ib-device"] *
                                                    bool(ctx.ib_device)))
            base = mce.MooncakeSettings.from_context(
                dataclasses.replace(ctx, env=env, ib_device=None))
            self.settings = dataclasses.replace(base, protocol="ascend", device_name="",
                                                force_tcp=False, force_hca=False)
            self.capabilities = Capabilities(
                memory_kinds=frozenset({MemoryKind.NPU, MemoryKind.HOST}))
            self.host = session_host(ctx.host)
            self.npu_phy_id = npu_phy_id(ctx.env or {}, ctx.gpu_id)
            local = f"{self.host}:{_free_port(self.host)}:npu_{self.npu_phy_id}"
            self._engine = mce.mc.TransferEngine()
            rc = self._engine.initialize(local, "P2PHANDSHAKE", "ascend", "")
            if rc != 0:
                self._engine = None
                raise TransferError(f"mooncake TransferEngine.initialize({local!r}, 'P2PHANDSHAKE',"
                                    f" 'ascend', '') returned {rc}; see the mooncake log above")
            self.rpc_port = int(self._engine.get_rpc_port())
            self.transport, self.fallback_warning = "ascend", None
            self._budget = mce.InflightBudget(self.settings.inflight_per_peer)
            self._workers = mce.TransferWorkers(self.settings.thread_pool_size,
                                                self.settings.queue_size)
            self._registered: dict[int, int] = {}

    return MooncakeAscendEngine


def create(ctx: BackendContext) -> TransferEngine:
    mce = load_engine_module()
    check_wheel()
    return engine_class(mce)(ctx)
