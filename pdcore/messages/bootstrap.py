"""What a prefill instance publishes on its bootstrap port: every rank registers its control
address with the instance's facts (`PUT /route`: a `RankRoute` and a `BootstrapInfo`), and a
decode server reads the facts back (`GET /route?prefill_dp_rank=-1&target_tp_rank=-1`) before it
pairs. Both are JSON on the wire and typed here, read field by field (`from_json`), never by
key: a field of the wrong type is a ValueError naming it. Fields an older peer (or a unit test)
does not send are None and are not compared at pairing (pdcore.disagg.wire.check_pairing)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

def _field(obj: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = obj.get(name)
    if value is None:  # absent or null: the default (an older peer sends fewer fields)
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")
    return value


def _read(cls: Any, obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{cls.__name__} must be a JSON object")
    out = {}
    for f in dataclasses.fields(cls):
        kind = f.metadata["kind"]
        required = f.default is dataclasses.MISSING
        if required and obj.get(f.name) is None:
            raise ValueError(f"{f.name} is missing")
        out[f.name] = _field(obj, f.name, kind, None if required else f.default)
    return out


def _f(kind: type, default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"kind": kind})


@dataclass(frozen=True)
class BootstrapInfo:
    """A prefill instance's facts, the same from every rank (the bootstrap server refuses a
    rank that disagrees, naming the fields): its parallel shape, KV layout, draft head and
    chain start, model, transfer backend and protocol version."""

    tp_size: int = _f(int)
    page_size: int = _f(int)
    kv_cache_dtype: str = _f(str)
    dp_size: int = _f(int, 1)
    is_mla: bool | None = _f(bool, None)
    total_kv_heads: int | None = _f(int, None)
    num_layers: int | None = _f(int, None)
    head_dim: int | None = _f(int, None)
    draft_layers: int | None = _f(int, None)  # None with num_layers given: no draft head
    chain_hidden: int | None = _f(int, None)  # a draft head's chain start in the aux rows
    chain_dtype: str | None = _f(str, None)
    chain_head: str | None = _f(str, None)
    model_fingerprint: str = _f(str, "")
    backend: str = _f(str, "")
    protocol_version: int | None = _f(int, None)
    instance_id: str = _f(str, "")  # set by the bootstrap server when it answers

    @classmethod
    def from_json(cls, obj: Any) -> BootstrapInfo:
        info = cls(**_read(cls, obj))
        if info.tp_size < 1 or info.dp_size < 1 or info.page_size < 1:
            raise ValueError("tp_size, dp_size and page_size must be >= 1")
        return info

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def differs(self, other: BootstrapInfo) -> list[str]:
        """The fields this instance's facts and `other`'s disagree on (the instance id aside)."""
        return [f.name for f in dataclasses.fields(self) if f.name != "instance_id"
                and getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class RankRoute:
    """One prefill rank's control address, registered with PUT /route beside the facts."""

    rank_ip: str = _f(str)
    rank_port: int = _f(int)
    tp_rank: int = _f(int)
    dp_rank: int = _f(int, 0)

    @classmethod
    def from_json(cls, obj: Any) -> RankRoute:
        route = cls(**_read(cls, obj))
        if not 0 < route.rank_port < 65536:
            raise ValueError("rank_port out of range")
        return route

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
