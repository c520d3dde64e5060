"""Typed name -> factory registries, one per plugin kind.

A registry is filled by the plugin host while it calls the pd_register_* hooks, then frozen:
lookups (`get`, `create`, `names`, `entries`) are the only operations afterwards. A name two
plugins both registered is a *conflict*: it is kept out of `names()` and every lookup of it raises
DuplicateNameError naming both owners, so neither silently wins by load order.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdcore.errors import DuplicateNameError, PluginError, UnavailableError, UnknownNameError
from pdcore.plugins.first_party import provider_hint


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
    # transfer backends only: the memory pool the KV must live in for this backend to reach it
    # (e.g. "shm"), or a callable (environment -> pool name or None) deciding at server start;
    # used when the user gave no --memory-pool
    memory_pool: str | Callable[[Mapping[str, str]], str | None] | None = None
    # settings this entry reads beyond the core's: ServerArgs field names (e.g.
    # "disaggregation_ib_device") and environment variable names; the core warns at start when
    # one of them is set but the chosen entry does not read it (pdcore.preflight)
    reads: frozenset[str] = frozenset()

    def available(self) -> tuple[bool, str]:
        if self.availability is None:
            return True, ""
        try:
            ok, reason = self.availability()
        except Exception as e:  # noqa: BLE001 - a probe must never take the host down
            return False, f"availability check raised {type(e).__name__}: {e}"
        return bool(ok), str(reason or "")

    def pool_for(self, env: Mapping[str, str]) -> str | None:
        """The memory pool this (transfer backend) entry needs under `env`, if any."""
        return self.memory_pool(env) if callable(self.memory_pool) else self.memory_pool

    @property
    def owner(self) -> str:
        """`distribution version (plugin name)`, as error messages show it."""
        version = f" {self.version}" if self.version else ""
        return f"{self.distribution}{version} (plugin {self.plugin})"


def _check_name(kind: Kind, name: object) -> str:
    if not isinstance(name, str) or not name or name != name.strip().lower() or " " in name:
        raise PluginError(
            f"{kind.value} name {name!r} must be a non-empty lowercase word without spaces"
        )
    return name


class Registry:
    def __init__(self, kind: Kind, hint: Callable[[], str] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._conflicts: dict[str, list[Entry]] = {}
        self._frozen = False
        # extra text for "unknown name" errors (e.g. which plugins failed to load); host-provided
        self._hint = hint

    # -- filling (plugin host only) ---------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """Add an entry; raises DuplicateNameError when the name is taken (nothing changes)."""
        if self._frozen:
            raise PluginError(
                f"{self.kind.value} registry is read-only after plugins loaded; register "
                f"{entry.name!r} from a pd_register_* hook instead"
            )
        name = _check_name(self.kind, entry.name)
        if not callable(entry.factory):
            raise PluginError(
                f"{self.kind.value} {name!r}: factory {entry.factory!r} is not callable")
        if entry.availability is not None and not callable(entry.availability):
            raise PluginError(
                f"{self.kind.value} {name!r}: availability must be a callable or None")
        if name in self._entries or name in self._conflicts:
            raise DuplicateNameError(self._duplicate_message(name, [*self._owners(name), entry]))
        self._entries[name] = entry

    def add_conflict(self, entry: Entry) -> None:
        """Record that `entry` re-registered a taken name: the name becomes unusable."""
        prev = self._entries.pop(entry.name, None)
        owners = self._conflicts.setdefault(entry.name, [])
        if prev is not None:
            owners.append(prev)
        owners.append(entry)

    def freeze(self) -> None:
        self._frozen = True

    # -- lookups ----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def conflicts(self) -> dict[str, list[Entry]]:
        """Names registered by more than one plugin -> every registering entry."""
        return {n: list(v) for n, v in sorted(self._conflicts.items())}

    def get(self, name: str) -> Entry:
        if name in self._conflicts:
            raise DuplicateNameError(self._duplicate_message(name, self._conflicts[name]))
        try:
            return self._entries[name]
        except KeyError:
            pass
        installed = ", ".join(self.names()) or "none"
        not_installed = provider_hint(self.kind.value, str(name))
        if not_installed:  # a first-party plugin the user has not installed: say which, and how
            raise UnknownNameError(f"{not_installed}. Installed {self.kind.value} names: "
                                   f"{installed}. Run `pdserve plugins` to see every plugin.")
        msg = f"unknown {self.kind.value} {name!r}; installed: {installed}"
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        hint = self._hint() if self._hint is not None else ""
        if hint:
            msg += f". {hint}"
        raise UnknownNameError(msg + ". Run `pdserve plugins` to see every plugin.") from None

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Check availability, then call the factory. A factory whose import fails (missing
        SDK) raises UnavailableError with the import error, not a bare ImportError."""
        entry = self.get(name)
        ok, reason = entry.available()
        if not ok:
            raise UnavailableError(f"{self.kind.value} {name!r} is not available here: {reason}")
        try:
            return entry.factory(*args, **kwargs)
        except ImportError as e:
            raise UnavailableError(
                f"{self.kind.value} {name!r} from {entry.owner} failed to import: {e}. "
                f"Install what it needs or pick another {self.kind.value}."
            ) from e

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    # -- helpers ----------------------------------------------------------------------------

    def _owners(self, name: str) -> list[Entry]:
        if name in self._conflicts:
            return list(self._conflicts[name])
        return [self._entries[name]] if name in self._entries else []

    def _duplicate_message(self, name: str, owners: list[Entry]) -> str:
        who = " and ".join(e.owner for e in owners)
        plugins = ",".join(dict.fromkeys(e.plugin for e in owners))
        return (
            f"{self.kind.value} {name!r} is registered by more than one plugin: {who}. "
            f"Uninstall one, or disable one with PDCORE_DISABLE_PLUGINS (one of: {plugins}). "
            f"Installed {self.kind.value} names: {', '.join(self.names()) or 'none'}"
        )
