"""Which scheduler stat feeds which exported metric (docs/metrics.md is the table people read).

SGLang's names, types and buckets are facts read from its metrics collector; the values come
from our scheduler's `stats` answer (pdcore.engine.sched.scheduler.Scheduler.stats and the PD
extensions' queues).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# SGLang's default buckets (its tokenizer metrics collector)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)

Stats = dict[str, Any]


def _get(key: str) -> Callable[[Stats, Any], float]:
    return lambda s, _: s.get(key) or 0


def _tokens(key: str) -> Callable[[Stats, Any], float]:
    return lambda s, _: (s.get(key) or 0) * (s.get("page_size") or 1)


def _usage(s: Stats, _: Any) -> float:
    total = s.get("num_pages_total") or 0
    return (s.get("num_pages_used") or 0) / total if total else 0.0


# (name, help, value from (stats, gen_throughput), stats keys consumed)
SCHED_GAUGES: list[tuple[str, str, Callable[[Stats, Any], float], tuple[str, ...]]] = [
    ("sglang:num_running_reqs", "The number of running requests.",
     _get("num_running_reqs"), ("num_running_reqs",)),
    ("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
     _get("num_waiting_reqs"), ("num_waiting_reqs",)),
    ("sglang:num_used_tokens", "The number of used tokens (token slots of the KV pages in use).",
     _tokens("num_pages_used"), ("num_pages_used",)),
    ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
     _tokens("num_pages_total"), ("num_pages_total",)),
    ("sglang:token_usage", "The token usage (KV pages in use / pool pages).", _usage, ()),
    ("sglang:gen_throughput", "The generation throughput (token/s, last 10 s).",
     lambda s, gen: gen(), ()),
    ("sglang:cache_hit_rate", "The prefix cache hit rate (cached / prompt tokens, since start).",
     _get("cache_hit_rate"), ("cache_hit_rate",)),
    ("sglang:num_prefill_bootstrap_queue_reqs",
     "The number of requests in the prefill bootstrap queue.",
     _get("disagg_bootstrap_queue"), ("disagg_bootstrap_queue",)),
    ("sglang:num_prefill_inflight_queue_reqs",
     "The number of requests in the prefill inflight (transfer) queue.",
     _get("disagg_inflight_queue"), ("disagg_inflight_queue",)),
    ("sglang:num_decode_prealloc_queue_reqs",
     "The number of requests in the decode prealloc queue.",
     _get("disagg_prealloc_queue"), ("disagg_prealloc_queue",)),
    ("sglang:num_decode_transfer_queue_reqs",
     "The number of requests in the decode transfer queue.",
     _get("disagg_transfer_queue"), ("disagg_transfer_queue",)),
    ("sglang:spec_accept_length",
     "The average acceptance length of speculative decoding (tokens per verify, since start).",
     _get("spec_accept_length"), ("spec_accept_length",)),
    ("sglang:spec_accept_rate",
     "The acceptance rate of speculative decoding (accepted / draft tokens, since start).",
     _get("spec_accept_rate"), ("spec_accept_rate",)),
    # ours, from the same stats
    ("pdserve_kv_pages_used", "KV cache pages in use", _get("num_pages_used"), ()),
    ("pdserve_kv_pages_free", "KV cache pages free", _get("num_pages_free"),
     ("num_pages_free",)),
    ("pdserve_radix_cache_pages", "KV pages the prefix cache holds", _get("radix_cache_pages"),
     ("radix_cache_pages",)),
    ("pdserve_radix_cache_evictable_pages", "Cached KV pages no request holds (free to evict)",
     _get("radix_cache_evictable_pages"), ("radix_cache_evictable_pages",)),
]

# (name without _total, help, stats key of the running total)
SCHED_COUNTERS: list[tuple[str, str, str]] = [
    ("sglang:num_aborted_requests", "Number of requests aborted.", "aborted_total"),
    ("pdserve_radix_cache_evicted_pages", "KV pages evicted from the prefix cache",
     "radix_cache_evicted_pages_total"),
    ("pdserve_kv_pages_given_back_bytes", ("Bytes of free KV pool pages handed back to the "
     "kernel (madvise DONTNEED) once the engine had been idle PDSERVE_KV_GIVEBACK_IDLE_S "
     "seconds, since start"),
     "kv_pages_given_back_bytes_total"),
    ("pdserve_disagg_prefix_reused_tokens", ("Prompt tokens whose KV decode took from its "
     "prefix cache instead of receiving it"), "disagg_prefix_reused_tokens_total"),
    ("pdserve_disagg_prefix_reused_bytes", ("KV bytes decode did not receive thanks to its "
     "prefix cache"), "disagg_prefix_reused_bytes_total"),
    ("pdserve_disagg_prefix_skipped_pages", ("KV pages prefill did not send: decode held them "
     "cached"), "disagg_prefix_skipped_pages_total"),
]

# counters SGLang keeps in its tokenizer collector (label model_name only)
REQUEST_LEVEL = frozenset({"sglang:num_aborted_requests"})

# (snapshot key, name, help): the KV manager's per-room histograms (pdcore.disagg.transfer_stats);
# SGLang's four in its units and buckets (model_name, engine_type, tp_rank, pp_rank), then ours
# (+ backend, seconds)
XFER_HISTOGRAMS_SGLANG: list[tuple[str, str, str]] = [
    ("sglang_latency_ms", "sglang:kv_transfer_latency_ms",
     "Histogram of KV cache transfer latency in ms."),
    ("sglang_speed_gb_s", "sglang:kv_transfer_speed_gb_s",
     "Histogram of KV cache transfer speed in GB/s."),
    ("sglang_bootstrap_ms", "sglang:kv_transfer_bootstrap_ms",
     "Histogram of KV transfer bootstrap time in ms."),
    ("sglang_total_mb", "sglang:kv_transfer_total_mb",
     "Histogram of KV cache transfer size in MB."),
]
XFER_HISTOGRAMS: list[tuple[str, str, str]] = [
    ("latency_seconds", "pdserve_kv_transfer_latency_seconds",
     ("Per-room KV transfer time (P: first chunk queued to last landed; D: destination sent to "
     "KV received)")),
    ("speed_gb_s", "pdserve_kv_transfer_speed_gb_s",
     "Per-room KV transfer speed in GB/s (1e9 bytes/s) over that time"),
    ("bootstrap_seconds", "pdserve_kv_bootstrap_seconds",
     ("Per-room bootstrap time (room created to peer ready: P has every destination, D has "
     "resolved its prefill)")),
]

