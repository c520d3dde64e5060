"""What the HTTP process holds of its engine: `EngineHandle`, the one interface of every engine
handle (`EngineClient`: one scheduler process; `DPEngineClient`: --dp-size replicas behind one
handle, some of them `RemoteEngineClient`s on other nodes). `make_engine` returns it; the server
types its engine as it and uses nothing else (tests/test_engine_handle.py holds both classes to
it, member by member and signature by signature)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from pdcore.config import ServerArgs
from pdcore.messages.info import EngineInfo
from pdcore.messages.io import ControlKind, GenerateReq, TokenOut
from pdcore.messages.stats import StatsReport
from pdcore.runtime.handle import EngineState


@runtime_checkable
class EngineHandle(Protocol):
    """Start, serve, control, stop. Every failure is an EngineError carrying the HTTP status to
    answer with; `on_dead` is called once if the engine dies while serving."""

    args: ServerArgs
    on_dead: Callable[[str], None] | None

    @property
    def state(self) -> EngineState: ...

    @property
    def ready(self) -> bool: ...

    @property
    def error(self) -> str: ...

    @property
    def info(self) -> EngineInfo:
        """What the engine told about itself when it became ready (empty before)."""
        ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def pid(self) -> int | None:
        """The scheduler process's pid (DP: replica 0's); None before the start."""
        ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def require_ready(self) -> None:
        """Raise EngineError (503) unless the engine serves."""
        ...

    def generate(self, req: GenerateReq, timeout: float | None = None
                 ) -> AsyncIterator[TokenOut]:
        """The scheduler's messages for `req` until finished (an async generator: leaving it
        early aborts the request)."""
        ...

    def abort(self, rid: str, reason: str = "aborted") -> None: ...

    async def control(self, kind: ControlKind, args: dict[str, Any] | None = None,
                      timeout: float = 10.0) -> dict[str, Any]: ...

    async def stats(self, timeout: float = 10.0) -> StatsReport: ...
