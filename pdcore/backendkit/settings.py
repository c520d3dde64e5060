"""Backend settings read from the BackendContext's environment, validated at start-up."""

from __future__ import annotations

from collections.abc import Mapping

from pdcore.errors import ConfigError


def read_timeout(env: Mapping[str, str], name: str, default: float) -> float:
    """A PDCORE_*_TIMEOUT style setting in seconds: `default` when unset or blank, else a
    number > 0 (ConfigError naming the variable otherwise)."""
    raw = env.get(name)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {raw!r}")
    return value
