"""Plugin host: one pluggy manager per process, loaded lazily from the `pdcore` entry points.

1. the first call to `get_host()` builds a PluginManager with the hookspecs (nothing happens at
   import time, so a process started with multiprocessing `spawn` loads its own host on first
   use, and a forked child inherits its parent's read-only host);
2. every entry point in group `pdcore` passing PDCORE_PLUGINS / PDCORE_DISABLE_PLUGINS is
   imported and registered; one that fails to import, or whose hook implementations do not
   match the hookspecs, is recorded in `failures` and never stops the others. The `builtin`
   plugin ignores the allow list (it is the core's own cpu platform, pools and backends); only
   PDCORE_DISABLE_PLUGINS=builtin removes it;
3. each pd_register_* hook implementation is called once with a `register` callback bound to
   its registry and plugin; a bad registration or a raising hook is recorded as a failure of that
   plugin, and a name registered twice becomes a conflict (unusable, DuplicateNameError on use);
4. registries are then frozen for the life of the process.

Entry points are loaded here rather than by pluggy's `load_setuptools_entrypoints`, which
raises at the first plugin that fails to import and knows no allow/deny list: here one broken
plugin is a line in `pdserve plugins`, never a server that cannot start. Each hook gets a typed
`Registrar` (hookspecs.Register).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from pdcore.env import Env
from pdcore.errors import DuplicateNameError, PluginError
from pdcore.plugins import hookspecs
from pdcore.plugins.hookspecs import Availability, PoolChoice
from pdcore.plugins.registry import Entry, Kind, Registry

log = logging.getLogger(__name__)

GROUP = "pdcore"
BUILTIN = "builtin"  # entry-point name of the core's own plugin (pdcore.builtin.plugin)
ALLOW_ENV = Env.pdcore_plugins.name
DENY_ENV = Env.pdcore_disable_plugins.name
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
    """Loads plugins and fills one Registry per Kind. Read-only once constructed.

    env: environment to read PDCORE_PLUGINS / PDCORE_DISABLE_PLUGINS from (default this
      process's, pdcore.env).
    extra: in-process plugin objects (modules, classes, instances with @hookimpl functions),
      registered after the entry points and not filtered by the allow/deny lists (tests).
    entry_points: override the discovered entry points (tests); default: group `pdcore`.
    """

    def __init__(
        self,
        env: dict[str, str] | None = None,
        extra: list[Any] | None = None,
        *,
        entry_points: Iterable[metadata.EntryPoint] | None = None,
    ) -> None:
        e = Env(env)
        self.allow = _split_env(e.pdcore_plugins)
        self.deny = _split_env(e.pdcore_disable_plugins) or set()
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.failures: list[Failure] = []
        self.skipped: list[str] = []
        self.skip_reasons: dict[str, str] = {}
        self.registries = {k: Registry(k, hint=lambda: self.hint()) for k in Kind}
        eps = metadata.entry_points(group=GROUP) if entry_points is None else entry_points
        seen = self._load_entry_points(eps)
        self._note_unmatched(seen)
        for obj in extra or []:
            name = getattr(obj, "__name__", None) or type(obj).__name__
            self._register(name, obj, PluginInfo(name, "<in-process>", "", name))
        self._collect()
        for registry in self.registries.values():
            registry.freeze()

    # -- loading ----------------------------------------------------------------------------

    def _skip_reason(self, name: str) -> str | None:
        if name in self.deny:
            return f"disabled by {DENY_ENV}"
        if self.allow is not None and name not in self.allow and name != BUILTIN:
            return f"not in {ALLOW_ENV}"
        return None

    def _load_entry_points(self, eps: Iterable[metadata.EntryPoint]) -> set[str]:
        seen: set[str] = set()
        for ep in eps:
            seen.add(ep.name)
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else ""
            reason = self._skip_reason(ep.name)
            if reason is not None:
                if ep.name not in self.skip_reasons:
                    self.skipped.append(ep.name)
                    self.skip_reasons[ep.name] = reason
                continue
            prev = self.plugins.get(ep.name)
            if prev is not None:
                if (prev.distribution, prev.module) != (dist, ep.value):
                    self.failures.append(Failure(
                        ep.name, dist,
                        f"entry point name {ep.name!r} is already used by {prev.distribution} "
                        f"({prev.module}); rename one of the [project.entry-points.pdcore] keys",
                    ))
                continue  # else: the same distribution seen twice on sys.path
            try:
                mod = ep.load()
            except Exception as e:  # noqa: BLE001 - any import error is the plugin's failure
                log.warning("plugin %s (%s) failed to load: %s", ep.name, dist, e)
                self.failures.append(Failure(ep.name, dist, f"import {ep.value}: "
                                             f"{type(e).__name__}: {e}"))
                continue
            self._register(ep.name, mod, PluginInfo(ep.name, dist, version, ep.value))
        return seen

    def _note_unmatched(self, seen: set[str]) -> None:
        # a typo in PDCORE_PLUGINS / PDCORE_DISABLE_PLUGINS would otherwise go unnoticed
        for env_name, names in ((ALLOW_ENV, self.allow or set()), (DENY_ENV, self.deny)):
            for name in sorted(names - seen):
                self.failures.append(Failure(
                    name, "", f"{env_name} names {name!r} but no installed distribution has a "
                    f"'pdcore' entry point of that name; installed: {', '.join(sorted(seen))}",
                ))

    def _register(self, name: str, obj: Any, info: PluginInfo) -> None:
        try:
            self.pm.register(obj, name=name)
        except Exception as e:  # noqa: BLE001 - pluggy validates hookimpls against the specs
            self.failures.append(Failure(name, info.distribution, f"{type(e).__name__}: {e}"))
            return
        unknown = [
            hc.name for hc in self.pm.get_hookcallers(obj) or []
            if hc.spec is None  # an implementation of a hook nobody specified (typo?)
        ]
        if unknown:
            self.pm.unregister(obj, name=name)
            self.failures.append(Failure(
                name, info.distribution,
                f"implements unknown hook(s) {', '.join(sorted(unknown))}; known: "
                f"{', '.join(HOOKS.values())}",
            ))
            return
        self.plugins[name] = info

    def _collect(self) -> None:
        for kind, hook_name in HOOKS.items():
            registry = self.registries[kind]
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                info = self.plugins.get(impl.plugin_name) or PluginInfo(
                    impl.plugin_name, "?", "", impl.plugin_name
                )
                if impl.hookwrapper or impl.wrapper:
                    self.failures.append(Failure(
                        info.name, info.distribution,
                        f"{hook_name}: hook wrappers are not supported",
                    ))
                    continue
                try:
                    impl.function(register=Registrar(self, registry, info))
                except Exception as e:  # noqa: BLE001 - a broken hook is its plugin's failure
                    log.warning("plugin %s hook %s failed: %s", info.name, hook_name, e)
                    self.failures.append(Failure(
                        info.name, info.distribution, f"{hook_name}: {type(e).__name__}: {e}"
                    ))

    # -- queries ----------------------------------------------------------------------------

    def registry(self, kind: Kind) -> Registry:
        return self.registries[kind]

    def hint(self) -> str:
        """What an "unknown name" error should add: plugins that failed or were skipped."""
        parts = []
        failed = sorted({f.plugin for f in self.failures if f.plugin not in self.plugins})
        if failed:
            parts.append(f"plugins that failed to load: {', '.join(failed)}")
        if self.skipped:
            parts.append("skipped plugins: " + ", ".join(
                f"{n} ({self.skip_reasons[n]})" for n in self.skipped))
        return "; ".join(parts)


class Registrar:
    """The `register` callback of one plugin's hook for one kind (hookspecs.Register): adds an
    entry to the registry, and records a bad or duplicate one as that plugin's failure instead
    of raising into the hook (the plugin's other names stay usable; a duplicate name becomes a
    conflict that raises on use and shows in `pdserve plugins`)."""

    def __init__(self, host: PluginHost, registry: Registry, info: PluginInfo) -> None:
        self.host, self.registry, self.info = host, registry, info

    def __call__(self, name: str, factory: Callable[..., Any], *, description: str = "",
                 availability: Availability | None = None, memory_pool: PoolChoice | None = None,
                 reads: Iterable[str] = ()) -> None:
        info = self.info
        entry = Entry(self.registry.kind, name, factory, info.name, info.distribution,
                      info.version, description, availability, memory_pool,
                      frozenset(reads or ()))
        try:
            self.registry.add(entry)
        except DuplicateNameError as e:
            self.registry.add_conflict(entry)
            log.warning("%s", e)
            self.host.failures.append(Failure(info.name, info.distribution, str(e)))
        except PluginError as e:
            self.host.failures.append(Failure(info.name, info.distribution, str(e)))


_host: PluginHost | None = None
_building = False
_lock = threading.RLock()
_fork_hook = False


def _after_fork_in_child() -> None:
    # a fork taken while another thread held the lock would leave it held forever in the child
    global _lock
    _lock = threading.RLock()


def get_host() -> PluginHost:
    """The process-wide host, built on first use."""
    global _host, _building, _fork_hook
    if not _fork_hook and hasattr(os, "register_at_fork"):
        _fork_hook = True
        os.register_at_fork(after_in_child=_after_fork_in_child)
    with _lock:
        if _host is None:
            if _building:
                raise PluginError(
                    "a plugin called into the plugin registries while plugins were loading; "
                    "look names up in factories, not in pd_register_* hooks or at import time"
                )
            _building = True
            try:
                _host = PluginHost()
            finally:
                _building = False
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
