"""Prometheus metrics of one server, in a registry owned by its app (several apps may share a
process in tests). docs/metrics.md lists every name.

Whatever SGLang also measures is exported under SGLang's name, type, labels and buckets
(`sglang:*`), so SGLang's dashboards work unchanged; the rest is `pdserve_*`.

- Request-level series (tokens, TTFT/ITL/e2e, finished requests) are recorded by the HTTP
  process as requests run (`ServerMetrics`), labelled `model_name` as SGLang's tokenizer
  metrics are.
- Scheduler series are built at scrape time from the scheduler's `stats` answer
  (`StatsCollector`): gauges from its current values, counters from its running totals (so a
  counter is exported as one, never as a gauge), the KV-transfer histograms from the cumulative
  buckets the KV manager keeps. Labels as SGLang's scheduler metrics: model_name, engine_type
  (unified / prefill / decode), tp_rank, pp_rank.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from pdcore.messages.stats import StatsReport
from pdcore.server.metrics_map import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LEVEL,
    SCHED_COUNTERS,
    SCHED_GAUGES,
    TTFT_BUCKETS,
    XFER_HISTOGRAMS,
    XFER_HISTOGRAMS_SGLANG,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
THROUGHPUT_WINDOW_S = 10.0  # sglang:gen_throughput: tokens generated over the last 10 s
_EXTRA_PREFIX = "pdserve_scheduler_"


class _Generated:
    """The generation-token counter, also feeding the sliding window of sglang:gen_throughput."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, float]] = deque()  # (monotonic time, tokens)

    def inc(self, n: float = 1) -> None:
        self._counter.inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            self._prune(now)  # bounded even when nobody scrapes

    def throughput(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def _prune(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()


class ServerMetrics:
    def __init__(self, model_name: str = "default", engine_type: str = "unified",
                 tp_rank: int = 0) -> None:
        disable_created_metrics()  # no `*_created` gauge beside every counter (SGLang has none)
        r = self.registry = CollectorRegistry(auto_describe=True)
        # what the HTTP process measures per request (SGLang's tokenizer metrics), recorded into
        # by generation.py and app.py
        lab = ["model_name"]
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                                     lab, registry=r).labels(model_name)
        self.generation_tokens = _Generated(Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", lab,
            registry=r).labels(model_name))
        self.cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens.",
                                     lab, registry=r).labels(model_name)
        self.finished = Counter("sglang:num_requests", "Number of requests processed.", lab,
                                registry=r).labels(model_name)
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", lab,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", lab,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of end-to-end request latency in seconds.", lab,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.in_flight = Gauge("pdserve_http_requests_in_flight",
                               "Generate requests the HTTP process is serving", registry=r)
        self.draining = Gauge("pdserve_draining", "1 while the server drains (SIGTERM or POST "
                              "/drain): it refuses new requests and exits once idle",
                              registry=r)
        self.requests = Counter("pdserve_requests", "Generate requests by route and HTTP status",
                                ["route", "status"], registry=r)
        self.routes_refused = Counter(
            "pdserve_routes_refused", "PD requests refused with 403: their route was neither "
            "signed nor to a trusted prefill address (pdcore.route_auth)", registry=r)
        self.refusal_notices = Counter(
            "pdserve_route_refusal_notices", "Notices of a refused route sent to the prefill "
            "server it names, by result: sent, failed (not delivered), dropped (queue full), "
            "skipped (not a prefill server announced on this host: never contacted) "
            "(pdcore.route_refusal)", ["result"],
            registry=r)
        self.stats_collector = StatsCollector(
            {"model_name": model_name, "engine_type": engine_type, "tp_rank": str(tp_rank),
             "pp_rank": "0"}, self.generation_tokens.throughput)
        r.register(self.stats_collector)

    def update_from_stats(self, report: StatsReport) -> None:
        self.stats_collector.report = report

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_model_name(args: Any) -> str:
    """The model_name label: the name /v1/models reports (served name, else the model file's
    or folder's base name)."""
    if args.served_model_name:
        return str(args.served_model_name)
    path = args.model_path
    if not path:
        try:
            from pdcore.runtime import default_model_file

            path = default_model_file()
        except Exception:  # noqa: BLE001 - the engine reports a missing model itself
            return "default"
    return os.path.basename(str(path).rstrip("/")) or "default"


def metrics_engine_type(args: Any) -> str:
    mode = getattr(args, "disaggregation_mode", "null")
    return mode if mode in ("prefill", "decode") else "unified"


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _histograms(hist: dict[str, Any], table: list[tuple[str, str, str]], names: list[str],
                values: list[str]) -> Iterator[Metric]:
    """Histogram families from TransferStats bucket counts (one family per table row)."""
    for key, name, doc in table:
        h = hist.get(key)
        fam = HistogramMetricFamily(name, doc, labels=names)
        if h:
            cum, buckets = 0, []
            for bound, n in zip([*h["bounds"], float("inf")], h["counts"]):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)),
                                float(cum)))
            fam.add_metric(values, buckets, float(h["sum"]))
        yield fam


class StatsCollector:
    """Scheduler series from the last `stats` answer, built at scrape time."""

    def __init__(self, labels: dict[str, str], gen_throughput: Any) -> None:
        self.labels = labels
        self.report = StatsReport()
        self._gen_throughput = gen_throughput

    def describe(self) -> list[Metric]:
        return []  # families depend on the stats: nothing is checked at registration

    def collect(self) -> Iterator[Metric]:
        s, names, values = self.report.as_dict(), list(self.labels), list(self.labels.values())
        known: set[str] = {"kv_transfer"}
        for name, doc, fn, keys in SCHED_GAUGES:
            lab = name.startswith("sglang:")  # ours stay unlabelled, as they always were
            g = GaugeMetricFamily(name, doc, labels=names if lab else [])
            g.add_metric(values if lab else [], float(fn(s, self._gen_throughput) or 0.0))
            known.update(keys)
            yield g
        for name, doc, key in SCHED_COUNTERS:
            # SGLang counts aborted requests in its tokenizer: model_name only
            lab = names[:1] if name in REQUEST_LEVEL else names if name.startswith("sglang:") \
                else []
            c = CounterMetricFamily(name, doc, labels=lab)
            v = s.get(key)
            c.add_metric(values[:len(lab)], float(v) if _num(v) else 0.0)
            known.add(key)
            yield c
        yield from self._transfer(s.get("kv_transfer"))
        yield from self._extras(s, known, self.report.counters())

    def _transfer(self, x: Any) -> Iterator[Metric]:
        """sglang:kv_transfer_* (histograms, SGLang's units and buckets) and pdserve_kv_*
        (histograms in seconds, totals, rooms; + backend)."""
        names, values = list(self.labels), list(self.labels.values())
        x = x if isinstance(x, dict) else {}
        hist = x.get("hist", {})
        yield from _histograms(hist, XFER_HISTOGRAMS_SGLANG, names, values)
        fails = x.get("failures", [])
        for phase, name, doc in (
                ("bootstrap", "sglang:num_bootstrap_failed_reqs",
                 "The number of bootstrap failed requests."),
                ("transfer", "sglang:num_transfer_failed_reqs",
                 "The number of transfer failed requests.")):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(sum(n for p, _, n in fails if p == phase)))
            yield c
        names, values = names + ["backend"], values + [str(x.get("backend", ""))]
        totals = x.get("totals", {})
        for key, name, doc in (("bytes", "pdserve_kv_transfer_bytes",
                                ("KV bytes this rank moved (P: wrote; D: received into its "
                                "pages)")),
                               ("transfers", "pdserve_kv_transfers", ("Rooms whose KV transfer "
                                "completed"))):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(totals.get(key, 0)))
            yield c
        c = CounterMetricFamily("pdserve_kv_failures", "Failed rooms by phase (bootstrap / "
                                "transfer) and reason", labels=names + ["phase", "reason"])
        for phase, why, n in fails:
            c.add_metric(values + [phase, why], float(n))
        yield c
        g = GaugeMetricFamily("pdserve_kv_rooms", "Live rooms by state",
                              labels=names + ["state"])
        for state, n in x.get("rooms", {}).items():
            g.add_metric(values + [state], float(n))
        yield g
        yield from _histograms(hist, XFER_HISTOGRAMS, names, values)

    def _extras(self, s: dict[str, Any], known: set[str],
                counters: set[str]) -> Iterator[Metric]:
        """Every other numeric stat: the report's running totals as counters, the rest as
        gauges."""
        for k, v in s.items():
            if k in known or not _num(v):
                continue
            base = _EXTRA_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", k)
            if k in counters:
                c = CounterMetricFamily(base.removesuffix("_total"), f"scheduler total {k}")
                c.add_metric([], float(v))
                yield c
            else:
                g = GaugeMetricFamily(base, f"scheduler stat {k}")
                g.add_metric([], float(v))
                yield g
