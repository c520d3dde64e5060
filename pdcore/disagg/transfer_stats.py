"""Per-room KV-transfer measurements of one KV manager, for /metrics.

The manager's RoomStates reports every state change here (`on_state`); the room's bytes come
from the side that knows them (P: each chunk it wrote; D: the pages it reserved minus the
prefix it held). A room is measured only when it was created in Bootstrapping (a fake warm-up
room starts past it and moves nothing).

- bootstrap: creation -> WaitingForInput (P: every D rank's destination arrived; D: its prefill
  instance resolved);
- transfer: Transferring -> Success (P: first chunk queued until the last one landed and D was
  told; D: destination sent until the KV and aux row arrived, so it includes P's prefill);
- failures: by phase (bootstrap when the room failed in Bootstrapping, else transfer) and a
  short reason from a fixed set (the wire code when there is one).

Histograms are kept as bucket counts so the HTTP process (another process) can
export them as Prometheus histograms; `snapshot()` is what the scheduler's stats carry.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from typing import Any

from pdcore.disagg.states import KVPoll

# seconds: a page over loopback takes well under a millisecond, a stalled peer seconds
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0)
SPEED_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0)  # GB/s
BOOTSTRAP_BUCKETS = LATENCY_BUCKETS
# SGLang's histograms of the same measurements, in its units and with its buckets (its
# scheduler metrics collector): exported as sglang:kv_transfer_{latency_ms,speed_gb_s,
# bootstrap_ms,total_mb}
MS_BUCKETS_SGLANG = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
BOOTSTRAP_MS_BUCKETS_SGLANG = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
SPEED_BUCKETS_SGLANG = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)  # GB/s
MB_BUCKETS_SGLANG = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)  # MB (1e6 bytes)
HISTOGRAMS = {"latency_seconds": LATENCY_BUCKETS, "speed_gb_s": SPEED_BUCKETS,
              "bootstrap_seconds": BOOTSTRAP_BUCKETS,
              "sglang_latency_ms": MS_BUCKETS_SGLANG, "sglang_speed_gb_s": SPEED_BUCKETS_SGLANG,
              "sglang_bootstrap_ms": BOOTSTRAP_MS_BUCKETS_SGLANG,
              "sglang_total_mb": MB_BUCKETS_SGLANG}

# the failure reasons a label can carry: wire codes, then what a reason's text says
REASONS = ("timeout", "aborted", "shutdown", "peer_unreachable", "peer_failed",
           "session_failed", "unknown_session", "version_mismatch", "prefix_mismatch",
           "injected", "protocol", "other")
_KEYWORDS = (("injected failure", "injected"), ("timeout", "timeout"), ("abort", "aborted"),
             ("shutting down", "shutdown"), ("digest", "prefix_mismatch"),
             ("protocol version", "version_mismatch"), ("cannot reach", "peer_unreachable"),
             ("cannot bootstrap", "peer_unreachable"), ("is gone", "peer_unreachable"),
             ("lost", "peer_unreachable"), ("failed:", "peer_failed"))
_UNREACHABLE = tuple(k for k in _KEYWORDS if k[1] == "peer_unreachable")
_CODES = {"decode_abort": "aborted", "aborted": "aborted", "prefill_fault": "peer_failed",
          "session_failed": "session_failed", "unknown_session": "unknown_session",
          "version_mismatch": "version_mismatch"}


def failure_reason(code: str, reason: str) -> str:
    """The reason label of a failure: an unreachable peer or a timeout as such, else its wire
    code's, else a keyword of its text."""
    text = reason.lower()
    for word, label in _KEYWORDS[:2] + _UNREACHABLE:
        if word in text:
            return label
    if code in _CODES:
        return _CODES[code]
    for word, label in _KEYWORDS:
        if word in text:
            return label
    return "protocol" if code else "other"


class Buckets:
    """One histogram: observations per bucket (the i-th counts values in (bounds[i-1],
    bounds[i]]; the last one, above every bound, is +Inf), and their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v

    def snapshot(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class _Room:
    __slots__ = ("bytes", "created", "phase", "transferring")

    def __init__(self, now: float) -> None:
        self.created, self.transferring, self.bytes, self.phase = now, 0.0, 0, "bootstrap"


class TransferStats:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self.hist = {name: Buckets(b) for name, b in HISTOGRAMS.items()}
        self.totals: Counter[str] = Counter()  # bytes, transfers
        self.failures: Counter[tuple[str, str]] = Counter()  # (phase, reason)
        self.last: dict[str, float] = {"speed_gb_s": 0.0, "latency_ms": 0.0,
                                       "bootstrap_ms": 0.0, "total_mb": 0.0}

    def on_state(self, room: int, state: KVPoll, created: bool) -> None:
        """RoomStates' listener: `room` entered `state` (`created`: by create())."""
        now = time.monotonic()
        with self._lock:
            if created:
                if state is KVPoll.Bootstrapping:
                    self._rooms[room] = _Room(now)
                else:
                    self._rooms.pop(room, None)
                return
            r = self._rooms.get(room)
            if r is None:
                return
            if state is KVPoll.WaitingForInput and r.phase == "bootstrap":
                r.phase = "waiting"
                took = now - r.created
                self.hist["bootstrap_seconds"].observe(took)
                self.hist["sglang_bootstrap_ms"].observe(took * 1e3)
                self.last["bootstrap_ms"] = took * 1e3
            elif state is KVPoll.Transferring:
                r.phase, r.transferring = "transfer", now
            elif state is KVPoll.Success:
                self._rooms.pop(room, None)
                self._transferred(r, now)

    def _transferred(self, r: _Room, now: float) -> None:
        took = max(now - (r.transferring or r.created), 1e-9)
        speed = r.bytes / took / 1e9
        self.hist["latency_seconds"].observe(took)
        self.hist["speed_gb_s"].observe(speed)
        self.hist["sglang_latency_ms"].observe(took * 1e3)
        self.hist["sglang_speed_gb_s"].observe(speed)
        self.hist["sglang_total_mb"].observe(r.bytes / 1e6)
        self.totals["transfers"] += 1
        self.last.update(latency_ms=took * 1e3, speed_gb_s=speed, total_mb=r.bytes / 1e6)

    def add_bytes(self, room: int, n: int) -> None:
        """KV bytes moved for `room` (counted at once: a failed room's bytes moved too)."""
        with self._lock:
            self.totals["bytes"] += n
            r = self._rooms.get(room)
            if r is not None:
                r.bytes += n

    def failed(self, room: int, code: str, reason: str) -> None:
        """`room` failed (first failure only: the manager calls this once per room)."""
        with self._lock:
            r = self._rooms.pop(room, None)
            if r is not None:
                phase = "bootstrap" if r.phase == "bootstrap" else "transfer"
                self.failures[(phase, failure_reason(code, reason))] += 1

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"backend": self.backend,
                    "hist": {k: h.snapshot() for k, h in self.hist.items()},
                    "totals": dict(self.totals), "last": dict(self.last),
                    "failures": [[p, why, n] for (p, why), n in self.failures.items()]}

