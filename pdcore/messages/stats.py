"""The scheduler's stats as a typed report (`StatsReport`): every value by name with its kind,
built in the scheduler process (engine/sched/stats.py, the role extensions add their part),
carried over the IPC socket as it is, merged over DP replicas, and turned into /get_load's JSON
and /metrics series only at the HTTP edge (docs/metrics.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Kind(enum.Enum):
    TOTAL = "total"  # a count since start: a Prometheus counter; DP replicas' add up
    LOAD = "load"  # an amount now (requests, pages): a gauge; DP replicas' add up
    INFO = "info"  # a property or a ratio (flags, page size, rates): a gauge; replica 0's


# ratios recomputed from the merged totals when DP replicas' reports are merged
RATIOS: dict[str, tuple[str, str]] = {
    "cache_hit_rate": ("cache_hit_tokens_total", "prompt_tokens_total"),
    "spec_accept_length": ("spec_emitted_tokens_total", "spec_verifies_total"),
    "spec_accept_rate": ("spec_accepted_tokens_total", "spec_draft_tokens_total"),
}
# the per-replica gauges a merged report names dp{rank}_<key> (/metrics labels by the suffix)
REPLICA_LOADS = ("num_running_reqs", "num_waiting_reqs", "num_pages_used", "num_pages_free")


@dataclass
class StatsReport:
    """A scheduler's stats: every value by name with its kind, the KV-transfer snapshot of a PD
    role apart. It crosses the IPC socket as it is; the HTTP edge alone turns it into /get_load's
    JSON (`as_dict`, the names of docs/metrics.md) and Prometheus series (a TOTAL is a counter,
    the rest gauges). Values keep the order they were added in."""

    values: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, Kind] = field(default_factory=dict)
    kv_transfer: dict[str, Any] | None = None  # pdcore.disagg.transfer_stats snapshot (PD)
    replicas: list[dict[str, Any]] = field(default_factory=list)  # DP: each one's REPLICA_LOADS

    def add(self, kind: Kind, values: dict[str, Any]) -> StatsReport:
        for k, v in values.items():
            self.values[k], self.kinds[k] = v, kind
        return self

    def add_named(self, values: dict[str, Any], loads: tuple[str, ...] = ()) -> StatsReport:
        """Values whose names say their kind: `*_total` a TOTAL, those in `loads` a LOAD, the
        rest INFO."""
        for k, v in values.items():
            kind = Kind.TOTAL if k.endswith("_total") else Kind.LOAD if k in loads else Kind.INFO
            self.add(kind, {k: v})
        return self

    def update(self, other: StatsReport) -> StatsReport:
        self.values.update(other.values)
        self.kinds.update(other.kinds)
        if other.kv_transfer is not None:
            self.kv_transfer = other.kv_transfer
        return self

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def counters(self) -> set[str]:
        return {k for k, kind in self.kinds.items() if kind is Kind.TOTAL}

    def as_dict(self) -> dict[str, Any]:
        """/get_load's JSON (and what the metrics table reads by name)."""
        out = dict(self.values)
        if self.kv_transfer is not None:
            out["kv_transfer"] = self.kv_transfer
        for rank, loads in enumerate(self.replicas):
            out.update({f"dp{rank}_{k}": v for k, v in loads.items()})
        return out

    @classmethod
    def merge(cls, reports: list[StatsReport],
              merge_transfer: Any = None) -> StatsReport:
        """One server's report from its DP replicas': TOTAL and LOAD values add up, INFO is
        replica 0's (RATIOS recomputed), each replica's REPLICA_LOADS kept by rank;
        `merge_transfer` merges the KV-transfer snapshots (pdcore.runtime.stats)."""
        first = reports[0]
        out = cls(kinds=dict(first.kinds))
        for k, v in first.values.items():
            summed = first.kinds.get(k, Kind.INFO) is not Kind.INFO and isinstance(v, (int, float)) \
                and not isinstance(v, bool)
            out.values[k] = sum(r.values.get(k) or 0 for r in reports) if summed else v
        for name, (num, den) in RATIOS.items():
            if name in out.values and den in out.values:
                d = out.values[den]
                out.values[name] = out.values.get(num, 0) / d if d else 0.0
        if any(r.kv_transfer is not None for r in reports) and merge_transfer is not None:
            out.kv_transfer = merge_transfer([r.kv_transfer for r in reports])
        out.replicas = [{k: r.values[k] for k in REPLICA_LOADS if k in r.values}
                        for r in reports]
        return out


# the PD role queues a server reports in /get_load, each under queue_key(name)
PD_QUEUES = ("bootstrap", "inflight", "prealloc", "transfer")


def queue_key(name: str) -> str:
    """The /get_load and /metrics name of a PD role queue's length ("prealloc" ->
    "disagg_prealloc_queue"); RankLoad reads the same names back."""
    return f"disagg_{name}_queue"


def _count(value: Any) -> int:
    """A non-negative count from a JSON value (anything else: 0: a worker's answer is input)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return 0
    return max(0, int(min(value, 2**62)))


@dataclass
class RankLoad:
    """One DP rank's load as a worker's /get_load answers it (one JSON object per rank, the
    names of docs/metrics.md), read by the router field by field (`from_json`), never by key
    prefix: the PD queues are those of PD_QUEUES, under queue_key."""

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_tokens: int = 0
    num_pages_used: int = 0
    num_pages_total: int = 0
    prompt_tokens_total: int = 0
    cache_hit_tokens_total: int = 0
    queues: dict[str, int] = field(default_factory=dict)  # PD role queue -> requests in it
    kv_transfer: dict[str, Any] | None = None  # a PD server's transfer snapshot

    @classmethod
    def from_json(cls, obj: dict[str, Any], dp_rank: int = 0) -> RankLoad:
        kv = obj.get("kv_transfer")
        return cls(
            dp_rank=_count(obj.get("dp_rank", dp_rank)),
            num_running_reqs=_count(obj.get("num_running_reqs")),
            num_waiting_reqs=_count(obj.get("num_waiting_reqs")),
            num_tokens=_count(obj.get("num_tokens")),
            num_pages_used=_count(obj.get("num_pages_used")),
            num_pages_total=_count(obj.get("num_pages_total")),
            prompt_tokens_total=_count(obj.get("prompt_tokens_total")),
            cache_hit_tokens_total=_count(obj.get("cache_hit_tokens_total")),
            queues={q: _count(obj[queue_key(q)]) for q in PD_QUEUES if queue_key(q) in obj},
            kv_transfer=kv if isinstance(kv, dict) else None)


def _amount(value: Any) -> float:
    """A finite number from a JSON value (anything else: 0.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return 0.0
    return float(min(max(value, -1e300), 1e300))


def _maybe(value: Any) -> float | None:
    """A number from a JSON value; None when it is none (absent, null, a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return _amount(value)


@dataclass
class LastTransfer:
    """The last KV transfer a worker measured (`kv_transfer.last`)."""

    speed_gb_s: float | None = None
    latency_ms: float | None = None
    bootstrap_ms: float | None = None


@dataclass
class TransferTotals:
    """A PD worker's KV-transfer counters summed over its DP ranks, each rank's `kv_transfer`
    snapshot (pdcore.disagg.transfer_stats) read field by field (`add`): what the router's
    dashboard shows. A value that is no number counts 0 (a worker's answer is input)."""

    backend: str | None = None
    transfers: int = 0
    bytes: int = 0
    failures: int = 0  # summed over the (phase, reason, count) rows
    speed_sum: float = 0.0  # the speed histogram's sum and count: mean GB/s = sum / count
    speed_count: int = 0
    last: LastTransfer | None = None  # the first rank's that reports one

    @classmethod
    def of(cls, snapshots: list[Any]) -> TransferTotals | None:
        """The totals of the ranks' snapshots; None when no rank reports one (unified)."""
        out: TransferTotals | None = None
        for kv in snapshots:
            if isinstance(kv, dict):
                if out is None:
                    backend = kv.get("backend")
                    out = cls(backend=backend if isinstance(backend, str) else None)
                out.add(kv)
        return out

    def add(self, kv: dict[str, Any]) -> None:
        totals = kv.get("totals")
        totals = totals if isinstance(totals, dict) else {}
        self.transfers += _count(totals.get("transfers"))
        self.bytes += _count(totals.get("bytes"))
        for row in kv.get("failures") or ():
            if isinstance(row, (list, tuple)) and row:
                self.failures += _count(row[-1])
        hist = kv.get("hist")
        speed = hist.get("speed_gb_s") if isinstance(hist, dict) else None
        if isinstance(speed, dict):
            self.speed_sum += _amount(speed.get("sum"))
            counts = speed.get("counts")
            self.speed_count += sum(_count(c) for c in counts) \
                if isinstance(counts, (list, tuple)) else 0
        last = kv.get("last")
        if isinstance(last, dict) and self.last is None:
            self.last = LastTransfer(_maybe(last.get("speed_gb_s")),
                                     _maybe(last.get("latency_ms")),
                                     _maybe(last.get("bootstrap_ms")))
