"""Hook specifications. Every hook takes a `register` callback; the core owns the names.

`register(name, factory, *, description="", availability=None)`:
- name: lowercase identifier users select (`--backend NAME`, `--memory-pool NAME`, ...);
- factory: callable building the component (signatures below); it may import vendor SDKs;
- memory_pool (transfer backends only): the memory pool the KV must be allocated from for this
  backend to reach it (e.g. "shm"), or a callable (environment mapping -> pool name or None)
  that decides at server start; servers use it when --memory-pool is not given;
- reads (transfer backends): the ServerArgs fields (e.g. "disaggregation_ib_device") and
  environment variables (e.g. "SGLANG_MOONCAKE_CUSTOM_MEM_POOL") the backend uses; a server
  warns at start about one of these set for a backend that does not list it;
- availability: optional zero-argument callable -> (ok: bool, reason: str), cheap, must not
  raise; `pdserve plugins` shows the reason when ok is False (e.g. "nixl is not installed:
  pip install nixl").
A name of the same kind registered by two plugins becomes a conflict: it is reported by
`pdserve plugins`, and using it raises DuplicateNameError naming both owners (neither wins by load
order); the plugins' other names stay usable. Lazy helpers: pdcore.plugins.lazy (`lazy`,
`importable`). Reference with examples: docs/plugin-hooks.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from pdcore.plugins import hookspec

Availability = Callable[[], "tuple[bool, str]"]
PoolChoice = str | Callable[[Mapping[str, str]], "str | None"]


class Register(Protocol):
    """The `register` callback each hook receives (the module docstring says what each argument
    means); the plugin host hands a pdcore.plugins.host.Registrar, one per plugin and kind."""

    def __call__(self, name: str, factory: Callable[..., Any], *, description: str = "",
                 availability: Availability | None = None, memory_pool: PoolChoice | None = None,
                 reads: Iterable[str] = ()) -> None: ...


@hookspec
def pd_register_transfer_backends(register: Register) -> None:
    """Register KV transfer backends.

    Called by: the plugin host, once per process, the first time any registry is read.
    factory(ctx: pdcore.interfaces.transfer.BackendContext) -> TransferEngine.
    Rule: the hook itself imports only stdlib and pdcore; import the vendor SDK inside the
    factory (or in availability, guarded) so a missing SDK never breaks other plugins.
    """


@hookspec
def pd_register_memory_pools(register: Register) -> None:
    """Register KV / aux memory pools.

    Called by: the plugin host, once per process, the first time any registry is read.
    factory(ctx: pdcore.interfaces.memory.PoolContext) -> MemoryPool.
    Rule: same lazy-import rule as transfer backends.
    """


@hookspec
def pd_register_platforms(register: Register) -> None:
    """Register device platforms (cpu, cuda, npu ...).

    Called by: the plugin host, once per process, the first time any registry is read.
    factory() -> Platform. Rule: availability must answer without touching hardware that may
    hang; a platform unusable here reports why.
    """


@hookspec
def pd_register_transfer_planners(register: Register) -> None:
    """Register transfer planners (KV pages -> CopyBatch).

    Called by: the plugin host, once per process, the first time any registry is read.
    factory() -> TransferPlanner. The core picks `default` unless a configuration (e.g.
    SGLANG_DISAGG_STAGING_BUFFER=1) selects another by name.
    """
