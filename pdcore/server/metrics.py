"""Prometheus metrics of one server, in a registry owned by its app (several apps may share a
process in tests).

Request-level series (tokens, latencies, request counts) are recorded by the HTTP process as
requests run; scheduler gauges (running / waiting requests, KV pages) are refreshed from a
`stats` ControlReq when /metrics is scraped. Any other numeric value the scheduler reports is
exported as `pdserve_scheduler_<key>`.
"""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                    0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# scheduler stats key -> our gauge; several spellings accepted
_STAT_KEYS = {
    "running": ("num_running_reqs", "running", "num_running"),
    "waiting": ("num_waiting_reqs", "waiting", "num_waiting"),
    "pages_used": ("num_pages_used", "pages_used", "used_pages"),
    "pages_free": ("num_pages_free", "pages_free", "free_pages"),
    "cache_hit_rate": ("cache_hit_rate",),
    "cache_pages": ("radix_cache_pages",),
    "cache_evictable": ("radix_cache_evictable_pages",),
}
# scheduler totals exported as counters (advanced by the difference since the last scrape)
_COUNTER_KEYS = {
    "cache_evicted": "radix_cache_evicted_pages_total",
    "prefix_reused_tokens": "disagg_prefix_reused_tokens_total",
    "prefix_reused_bytes": "disagg_prefix_reused_bytes_total",
    "prefix_skipped_pages": "disagg_prefix_skipped_pages_total",
}


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.running = Gauge("pdserve_num_running_reqs", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge("pdserve_num_waiting_reqs", "Requests waiting for admission",
                             registry=r)
        self.pages_used = Gauge("pdserve_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_free = Gauge("pdserve_kv_pages_free", "KV cache pages free", registry=r)
        self.in_flight = Gauge("pdserve_http_requests_in_flight",
                               "Generate requests the HTTP process is serving", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("pdserve_cached_tokens", "Prompt tokens served from cache",
                                     registry=r)
        self.requests = Counter("pdserve_requests", "Generate requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request latency",
                             buckets=_E2E_BUCKETS, registry=r)
        self.cache_hit_rate = Gauge("pdserve_cache_hit_rate", "Prompt tokens taken from the "
                                    "prefix cache / prompt tokens, since start", registry=r)
        self.cache_pages = Gauge("pdserve_radix_cache_pages", "KV pages the prefix cache holds",
                                 registry=r)
        self.cache_evictable = Gauge("pdserve_radix_cache_evictable_pages", "Cached KV pages no "
                                     "request holds (free to evict)", registry=r)
        self.cache_evicted = Counter("pdserve_radix_cache_evicted_pages", "KV pages evicted "
                                     "from the prefix cache", registry=r)
        # decode-side prefix reuse (pdcore.disagg): KV decode's own cache held, not transferred
        self.prefix_reused_tokens = Counter("pdserve_disagg_prefix_reused_tokens", "Prompt "
                                            "tokens whose KV decode took from its prefix cache "
                                            "instead of receiving it", registry=r)
        self.prefix_reused_bytes = Counter("pdserve_disagg_prefix_reused_bytes", "KV bytes "
                                           "decode did not receive thanks to its prefix cache",
                                           registry=r)
        self.prefix_skipped_pages = Counter("pdserve_disagg_prefix_skipped_pages", "KV pages "
                                            "prefill did not send: decode held them cached",
                                            registry=r)
        self._totals: dict[str, float] = {}
        self._extra: dict[str, Gauge] = {}

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        known: set[str] = set()
        for attr, keys in _STAT_KEYS.items():
            for k in keys:
                if isinstance(stats.get(k), (int, float)):
                    getattr(self, attr).set(stats[k])
                    known.add(k)
                    break
        for attr, k in _COUNTER_KEYS.items():
            v = stats.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                getattr(self, attr).inc(max(0.0, v - self._totals.get(k, 0.0)))
                self._totals[k] = v
                known.add(k)
        for k, v in stats.items():
            if k in known or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            name = "pdserve_scheduler_" + re.sub(r"[^a-zA-Z0-9_]", "_", k)
            g = self._extra.get(name)
            if g is None:
                g = self._extra[name] = Gauge(name, f"scheduler stat {k}", registry=self.registry)
            g.set(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)
