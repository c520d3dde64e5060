"""Typed name -> factory registries, one per plugin kind."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcore.errors import DuplicateNameError, UnavailableError, UnknownNameError


class Kind(str, enum.Enum):
    TRANSFER_BACKEND = "transfer_backend"
    MEMORY_POOL = "memory_pool"
    PLATFORM = "platform"
    TRANSFER_PLANNER = "transfer_planner"


@dataclass(frozen=True, slots=True)
class Entry:
    kind: Kind
    name: str
    factory: Callable[..., Any]
    plugin: str  # plugin (entry point) name
    distribution: str
    version: str
    description: str = ""
    availability: Callable[[], tuple[bool, str]] | None = None

    def available(self) -> tuple[bool, str]:
        if self.availability is None:
            return True, ""
        try:
            ok, reason = self.availability()
        except Exception as e:  # an availability probe must never take the host down
            return False, f"availability check raised {type(e).__name__}: {e}"
        return bool(ok), str(reason or "")


class Registry:
    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> None:
        name = entry.name
        if not name or name != name.strip().lower():
            raise ValueError(f"{self.kind.value} name {name!r} must be a non-empty lowercase word")
        if name in self._entries:
            prev = self._entries[name]
            raise DuplicateNameError(
                f"{self.kind.value} {name!r} registered twice: by {prev.distribution} "
                f"(plugin {prev.plugin}) and by {entry.distribution} (plugin {entry.plugin}). "
                f"Uninstall one or disable it with PDCORE_DISABLE_PLUGINS. "
                f"Installed: {', '.join(self.names())}"
            )
        self._entries[name] = entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def get(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind.value} {name!r}; installed: {', '.join(self.names()) or 'none'}"
                f" (see `pdserve plugins`)"
            ) from None

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        entry = self.get(name)
        ok, reason = entry.available()
        if not ok:
            raise UnavailableError(f"{self.kind.value} {name!r} is not available here: {reason}")
        return entry.factory(*args, **kwargs)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
