"""Which engine handle serves a server's arguments: one scheduler process (`EngineClient`), or
`--dp-size` N replicas behind one handle (`DPEngineClient`, whose DP ranks on other nodes are
`RemoteEngineClient`s)."""

from __future__ import annotations

from typing import Any

from pdcore.config import ServerArgs
from pdcore.runtime.dp.client import DPEngineClient
from pdcore.runtime.engine_handle import EngineHandle
from pdcore.runtime.handle import EngineClient, SchedulerTarget


def make_engine(args: ServerArgs, *, scheduler_target: SchedulerTarget | None = None,
                tokenizer: Any = None, **kwargs: Any) -> EngineHandle:
    """The handle for `args`, not started yet. `scheduler_target` / `tokenizer` replace the real
    scheduler process function and tokenizer (tests); `kwargs`: EngineClient's timeouts."""
    if args.dp_size > 1:  # N replicas behind this server
        return DPEngineClient(args, scheduler_target=scheduler_target, tokenizer=tokenizer,
                              **kwargs)
    return EngineClient(args, scheduler_target=scheduler_target, tokenizer=tokenizer, **kwargs)
