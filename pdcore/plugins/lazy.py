"""Register components by "module:attr" path so nothing heavy is imported until it is chosen.

    from pdcore.plugins.lazy import importable, lazy

    @hookimpl
    def pd_register_transfer_backends(register):
        path = "my_pkg.engine:MyEngine"
        register("mine", lazy(path), availability=importable(path, install="pip install my-sdk"))

`lazy(path)` imports on the first call (in the process that calls it, so it is safe under
multiprocessing spawn) and then calls the attribute with the factory's arguments.
`importable(path)` answers availability from `importlib.util.find_spec` without importing the
module (a parent package is imported, as find_spec requires). `sdk_probe(...)` imports a
plugin's SDK-importing module once and says which SDK is missing or broken; `guarded(...)` is a
factory that raises UnavailableError with that reason before importing anything heavy.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable
from typing import Any


def split_path(path: str) -> tuple[str, str]:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected 'package.module:attribute', got {path!r}")
    return module, attr


def load(path: str) -> Any:
    """Import `module` and return `attr` (dotted attributes allowed: "mod:Outer.inner")."""
    module, attr = split_path(path)
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{module} has no attribute {attr!r} (from {path!r})") from None
    return obj


class LazyFactory:
    """Callable that resolves `path` once, then forwards every call to it."""

    __slots__ = ("_lock", "_target", "path")

    def __init__(self, path: str) -> None:
        split_path(path)  # validate early: a typo shows when the plugin registers
        self.path = path
        self._target: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def resolve(self) -> Callable[..., Any]:
        with self._lock:
            if self._target is None:
                self._target = load(self.path)
            return self._target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"lazy({self.path!r})"

    def __reduce__(self) -> tuple[Any, tuple[str]]:  # picklable (a lock is not): re-resolves
        return (LazyFactory, (self.path,))


def lazy(path: str) -> LazyFactory:
    """A factory importing "module:attr" on first call and calling it with the given args."""
    return LazyFactory(path)


def importable(path: str, install: str = "") -> Callable[[], tuple[bool, str]]:
    """Availability probe: (True, "") if the module of `path` can be found, else why not."""
    module, _ = split_path(path)

    def probe() -> tuple[bool, str]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as e:  # a parent package is missing or broken
            found, detail = False, f" ({type(e).__name__}: {e})"
        else:
            detail = ""
        if found:
            return True, ""
        todo = f"; {install}" if install else ""
        return False, f"module {module} not found{detail}{todo}"

    return probe


def sdk_probe(module: str, sdk: str, packages: tuple[str, ...], install: str,
              broken: str) -> Callable[[], tuple[bool, str]]:
    """Availability probe for a plugin whose `module` imports a vendor SDK: imports it once
    (cached) and answers (True, "") or why not. A missing top-level package of `packages` is
    "<sdk> is not installed: <install>"; an SDK that fails to load is "<sdk> failed to import
    (...); <broken>"; any other import failure names `module`."""

    @functools.lru_cache(maxsize=1)
    def probe() -> tuple[bool, str]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in packages:
                return False, f"{sdk} is not installed: {install}"
            return False, f"{module} failed to import: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a broken SDK must not break the host
            return False, f"{sdk} failed to import ({type(e).__name__}: {e}); {broken}"
        return True, ""

    return probe


def guarded(kind: str, name: str, probe: Callable[[], tuple[bool, str]],
            path: str) -> Callable[..., Any]:
    """A factory that raises UnavailableError with `probe`'s reason when it answers False, else
    calls "module:attr" `path` (imported then) with the factory's arguments."""

    def create(*args: Any, **kwargs: Any) -> Any:
        ok, reason = probe()
        if not ok:
            from pdcore.errors import UnavailableError

            raise UnavailableError(f"{kind} '{name}' is not available here: {reason}")
        return load(path)(*args, **kwargs)

    return create
