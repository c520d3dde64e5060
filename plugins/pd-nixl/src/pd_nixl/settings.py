"""NIXL backend settings, parsed from the BackendContext environment in one place (stdlib only).

- SGLANG_DISAGGREGATION_NIXL_BACKEND: the NIXL plugin to move data with: UCX (default),
  LIBFABRIC, or any plugin NIXL reports as installed (checked against that list at start-up).
- SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS: a JSON object of backend parameters, e.g.
  {"num_workers": 2}; values are passed to NIXL as strings.
- PDCORE_NIXL_PROGRESS: who drives NIXL's progress on the receiving side:
  "pump" (default): a pdserve thread makes one NIXL call every PDCORE_NIXL_PUMP_MS (1 ms);
  "thread": NIXL's own progress thread, which busy-polls a whole core per agent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdcore.env import Env
from pdcore.errors import ConfigError

# declared (name, documented default, meaning) in pdcore/env.py; parsed here, from the mapping the
# backend is handed (ctx.env)
BACKEND_ENV = Env.sglang_disaggregation_nixl_backend.name
PARAMS_ENV = Env.sglang_disaggregation_nixl_backend_params.name
PROGRESS_ENV = Env.pdcore_nixl_progress.name
PUMP_ENV = Env.pdcore_nixl_pump_ms.name
PROGRESS_MODES = ("pump", "thread")


def parse_params(raw: str | None) -> dict[str, str]:
    """The params JSON object as NIXL wants it (str -> str)."""
    if raw is None or not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{PARAMS_ENV} is not valid JSON ({e}); use an object such as "
                          f'{{"num_workers": "2"}}') from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{PARAMS_ENV} must be a JSON object of backend parameters, "
                          f"got {type(obj).__name__}")
    out: dict[str, str] = {}
    for key, value in obj.items():
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[key] = str(value)
        else:
            raise ConfigError(f"{PARAMS_ENV}: parameter {key!r} must be a string, number or "
                              f"boolean, got {type(value).__name__}")
    return out


@dataclass(frozen=True, slots=True)
class NixlSettings:
    backend: str
    params: dict[str, str] = field(default_factory=dict)
    progress: str = "pump"
    pump_interval_s: float = 0.001

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NixlSettings:
        backend = (env.get(BACKEND_ENV) or "UCX").strip()
        if not backend:
            backend = "UCX"
        progress = (env.get(PROGRESS_ENV) or "pump").strip().lower()
        if progress not in PROGRESS_MODES:
            raise ConfigError(f"{PROGRESS_ENV}={env.get(PROGRESS_ENV)!r} is not supported; use "
                              f"pump (default) or thread")
        raw_ms = env.get(PUMP_ENV)
        try:
            pump_ms = float(raw_ms) if raw_ms and raw_ms.strip() else 1.0
        except ValueError:
            raise ConfigError(f"{PUMP_ENV} must be a number of milliseconds, got {raw_ms!r}") from None
        if not 0 < pump_ms <= 1000:
            raise ConfigError(f"{PUMP_ENV} must be in (0, 1000] milliseconds, got {raw_ms!r}")
        return cls(backend=backend, params=parse_params(env.get(PARAMS_ENV)), progress=progress,
                   pump_interval_s=pump_ms / 1000.0)

    @staticmethod
    def resolve(backend: str, available: list[str]) -> str:
        """The installed plugin name matching `backend` (case-insensitive), or ConfigError."""
        if backend in available:
            return backend
        by_upper = {name.upper(): name for name in available}
        if backend.upper() in by_upper:
            return by_upper[backend.upper()]
        raise ConfigError(
            f"{BACKEND_ENV}={backend!r} is not an installed NIXL plugin; NIXL reports these as "
            f"available: {', '.join(available) or 'none'}"
        )


def describe_error(exc: BaseException, data_path: bool = True) -> str:
    """NIXL's exception (its status code) with what that code means on the data path."""
    text = f"{type(exc).__name__}: {exc}"
    if not data_path:
        return text
    hints: dict[str, Any] = {
        "NIXL_ERR_REMOTE_DISCONNECT": "the peer disconnected (it exited or restarted)",
        "NIXL_ERR_NOT_FOUND": ("a range outside the registered memory of either side, or the "
                               "peer's metadata is not loaded"),
        "NIXL_ERR_BACKEND": "the NIXL backend failed; see the NIXL log",
        "NIXL_ERR_INVALID_PARAM": "NIXL rejected a parameter",
    }
    for code, hint in hints.items():
        if code in str(exc):
            return f"{text} ({hint})"
    return text
