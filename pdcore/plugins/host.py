"""Plugin host: one pluggy manager per process, loaded lazily from the `pdcore` entry points.

1. first call to `get_host()` builds a PluginManager with the hookspecs;
2. every entry point in group `pdcore` passing PDCORE_PLUGINS / PDCORE_DISABLE_PLUGINS is loaded;
   a plugin that fails to import is recorded in `failures`, never fatal for the others;
3. each pd_register_* hook is called once with a `register` callback bound to its registry;
   a hook implementation that raises is recorded as a failure of its plugin;
4. registries are then read-only for the life of the process (safe under spawn: each process
   loads its own host on first use).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from pdcore.plugins import hookspecs
from pdcore.plugins.registry import Entry, Kind, Registry

log = logging.getLogger(__name__)

GROUP = "pdcore"
HOOKS: dict[Kind, str] = {
    Kind.TRANSFER_BACKEND: "pd_register_transfer_backends",
    Kind.MEMORY_POOL: "pd_register_memory_pools",
    Kind.PLATFORM: "pd_register_platforms",
    Kind.TRANSFER_PLANNER: "pd_register_transfer_planners",
}


@dataclass(frozen=True, slots=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


@dataclass(frozen=True, slots=True)
class Failure:
    plugin: str
    distribution: str
    reason: str


def _split_env(value: str | None) -> set[str] | None:
    if value is None or not value.strip():
        return None
    return {p.strip() for p in value.split(",") if p.strip()}


class PluginHost:
    def __init__(self, env: dict[str, str] | None = None, extra: list[Any] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.allow = _split_env(env.get("PDCORE_PLUGINS"))
        self.deny = _split_env(env.get("PDCORE_DISABLE_PLUGINS")) or set()
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.failures: list[Failure] = []
        self.skipped: list[str] = []
        self.registries = {k: Registry(k) for k in Kind}
        self._load_entry_points()
        for obj in extra or []:  # in-process plugins (tests)
            name = getattr(obj, "__name__", repr(obj))
            self.pm.register(obj, name=name)
            self.plugins[name] = PluginInfo(name, "<in-process>", "", name)
        self._collect()

    def _wanted(self, name: str) -> bool:
        if name in self.deny:
            return False
        return self.allow is None or name in self.allow

    def _load_entry_points(self) -> None:
        for ep in metadata.entry_points(group=GROUP):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else ""
            if not self._wanted(ep.name):
                self.skipped.append(ep.name)
                continue
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            try:
                mod = ep.load()
            except Exception as e:
                log.warning("plugin %s (%s) failed to load: %s", ep.name, dist, e)
                self.failures.append(Failure(ep.name, dist, f"{type(e).__name__}: {e}"))
                continue
            self.pm.register(mod, name=ep.name)
            self.plugins[ep.name] = PluginInfo(ep.name, dist, version, ep.value)

    def _collect(self) -> None:
        for kind, hook_name in HOOKS.items():
            registry = self.registries[kind]
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                info = self.plugins.get(impl.plugin_name) or PluginInfo(
                    impl.plugin_name, "?", "", impl.plugin_name
                )

                def register(name: str, factory: Any, *, description: str = "",
                             availability: Any = None, _info: PluginInfo = info,
                             _reg: Registry = registry) -> None:
                    _reg.add(Entry(_reg.kind, name, factory, _info.name, _info.distribution,
                                   _info.version, description, availability))

                try:
                    impl.function(register=register)
                except Exception as e:
                    log.warning("plugin %s hook %s failed: %s", info.name, hook_name, e)
                    self.failures.append(
                        Failure(info.name, info.distribution, f"{hook_name}: {type(e).__name__}: {e}")
                    )
                    if isinstance(e, (ValueError,)) or type(e).__name__ == "DuplicateNameError":
                        raise

    def registry(self, kind: Kind) -> Registry:
        return self.registries[kind]


_host: PluginHost | None = None
_lock = threading.Lock()


def get_host() -> PluginHost:
    global _host
    with _lock:
        if _host is None:
            _host = PluginHost()
        return _host


def reset_host(host: PluginHost | None = None) -> None:
    """For tests: drop (or replace) the process-wide host."""
    global _host
    with _lock:
        _host = host


def transfer_backends() -> Registry:
    return get_host().registry(Kind.TRANSFER_BACKEND)


def memory_pools() -> Registry:
    return get_host().registry(Kind.MEMORY_POOL)


def platforms() -> Registry:
    return get_host().registry(Kind.PLATFORM)


def transfer_planners() -> Registry:
    return get_host().registry(Kind.TRANSFER_PLANNER)
