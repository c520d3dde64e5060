"""#46 item 4: one engine-handle type. `EngineHandle` (runtime/engine_handle.py) is the
protocol both handles implement, `EngineClient` (one scheduler) and `DPEngineClient` (--dp-size
replicas), and what `make_engine` returns, with no `# type: ignore`. Checked here member by
member and signature by signature (no engine is started: constructing a handle starts nothing)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import pdcore.runtime.engines as engines
from pdcore.config import ServerArgs
from pdcore.runtime import DPEngineClient, EngineClient, EngineHandle, make_engine


def _members() -> dict[str, object]:
    own = {k: v for k, v in vars(EngineHandle).items() if not k.startswith("_")}
    return {**own, **dict.fromkeys(EngineHandle.__annotations__)}


def _params(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("cls", [EngineClient, DPEngineClient])
def test_each_handle_has_every_method_of_the_protocol(cls: type) -> None:
    for name, proto in _members().items():
        if proto is None or isinstance(proto, property):  # a data member: checked below
            continue
        impl = getattr(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {name}"
        assert _params(impl) == _params(proto), f"{cls.__name__}.{name}: other parameters"
        # awaitable in the protocol, awaitable in the handle; generate: an async generator
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(proto), name
        if name == "generate":
            assert inspect.isasyncgenfunction(impl), f"{cls.__name__}.generate"


def _args(**kw: object) -> ServerArgs:
    return ServerArgs(model_path="unused", **kw)  # type: ignore[arg-type]


def test_make_engine_returns_an_engine_handle_for_one_or_many_replicas() -> None:
    one, many = make_engine(_args()), make_engine(_args(dp_size=2))
    assert type(one) is EngineClient and type(many) is DPEngineClient
    for handle in (one, many):
        assert isinstance(handle, EngineHandle)
        missing = [m for m in _members() if not hasattr(handle, m)]
        assert not missing, (type(handle).__name__, missing)
    assert "type: ignore" not in Path(engines.__file__).read_text()


def test_a_handle_missing_a_member_is_not_one() -> None:
    """The check above can fail: a handle without `stats` is not an EngineHandle."""
    class Partial(EngineClient):
        stats = None  # type: ignore[assignment]

    assert not isinstance(Partial(_args()), EngineHandle)
