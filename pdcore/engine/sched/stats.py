"""The scheduler's counters and its stats report (what /get_load answers and /metrics exports:
docs/metrics.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    preempted: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    steps: int = 0
    # forward passes and their wall time, by kind: "decode" (every request one token) and
    # "extend" (at least one prompt chunk; decodes may ride along), so /metrics shows where a
    # server's time goes (mean decode step = decode seconds / decode steps)
    decode_steps: int = 0
    decode_seconds: float = 0.0
    extend_steps: int = 0
    extend_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


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


def scheduler_stats(s: Any) -> StatsReport:
    """A Scheduler's report (/get_load, /metrics): queues, pages, counters, and those of its
    prefix cache, native kernels, role extension, grammars and speculation. `s` is the
    pdcore.engine.sched.scheduler.Scheduler (not imported: it imports this module)."""
    c = s.counters
    r = StatsReport()
    r.add(Kind.LOAD, {
        "num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
        "num_reqs": len(s.reqs), "num_pages_total": s.blocks.num_pages,
        "num_pages_free": s.blocks.num_free, "num_pages_used": s.blocks.num_used})
    r.add(Kind.INFO, {"page_size": s.blocks.page_size})
    r.add(Kind.LOAD, {"num_tokens": sum(q.seq_len for q in s.reqs.values())})
    r.add(Kind.TOTAL, {
        "prompt_tokens_total": c.prompt_tokens, "generation_tokens_total": c.generated_tokens,
        "finished_total": c.finished, "aborted_total": c.aborted,
        "preempted_total": c.preempted, "steps_total": c.steps,
        "forward_decode_steps_total": c.decode_steps,
        "forward_decode_seconds_total": c.decode_seconds,
        "forward_extend_steps_total": c.extend_steps,
        "forward_extend_seconds_total": c.extend_seconds})
    _native_stats(s, r)
    _cache_stats(s, r)
    r.update(s.ext.stats())
    _grammar_stats(s, r)
    if s.spec is not None:
        r.add_named(s.spec.stats(), loads=("spec_cache_entries",))
    return r


def _grammar_stats(s: Any, r: StatsReport) -> None:
    g = getattr(s.runner, "grammar", None)  # test runners may have none
    running = sum(1 for q in s.running if q.params.grammar is not None)
    r.add(Kind.TOTAL, {"grammar_compiled_total": g.compiled if g else 0,
                       "grammar_compile_seconds_total": g.compile_seconds if g else 0.0})
    r.add(Kind.LOAD, {"grammar_running_requests": running})


def _native_stats(s: Any, r: StatsReport) -> None:
    """Whether the native kernels serve (1/0) and on which ISA (native_isa_*: 1 for the
    library loaded), how many decode steps took the native layer loop (engine/native; the
    rest ran the Python loop), and how many GEMM weights sit in each layout
    (models/layers.py: chosen at load)."""
    from pdcore.engine import native
    from pdcore.engine.model.layers import weight_layouts

    if s.gemm_layouts is None:
        s.gemm_layouts = weight_layouts(s.runner.model)
    isa = native.isa()
    r.add(Kind.INFO, {"native_kernels": int(native.status().startswith("native")),
                      **{f"native_isa_{name}": int(isa == name) for name in native.ISAS}})
    r.add(Kind.TOTAL, {"native_decode_steps_total":
                       int(getattr(s.runner.model, "native_steps", 0))})
    r.add(Kind.INFO, {f"gemm_weights_{k}": v for k, v in s.gemm_layouts.items()})


def _cache_stats(s: Any, r: StatsReport) -> None:
    c, cache = s.counters, s.cache
    r.add(Kind.INFO, {"radix_cache_enabled": cache is not None})
    r.add(Kind.TOTAL, {"cache_hit_tokens_total": c.cached_tokens})
    r.add(Kind.INFO, {"cache_hit_rate": c.cached_tokens / c.prompt_tokens
                      if c.prompt_tokens else 0.0})
    r.add(Kind.LOAD, {"radix_cache_pages": cache.num_pages if cache else 0,
                      "radix_cache_evictable_pages": cache.evictable() if cache else 0})
    r.add(Kind.TOTAL, {
        "radix_cache_evicted_pages_total": cache.evicted_pages if cache else 0,
        "radix_cache_inserted_pages_total": cache.inserted_pages if cache else 0})
