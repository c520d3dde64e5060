"""The scheduler's stats as one server reports them: how the stats of DP replicas add up into
one server's (the KV-transfer measurements, pdcore.disagg.transfer_stats snapshots, included).
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's scheduler stats from its replicas': counts add up, the rest (page size,
    flags, ratios) is taken from replica 0 or recomputed."""
    out = dict(stats[0])
    for k, v in stats[0].items():
        if isinstance(v, int) and not isinstance(v, bool) and k != "page_size":
            out[k] = sum(int(s.get(k) or 0) for s in stats)
    prompt = out.get("prompt_tokens_total")
    if isinstance(prompt, int) and "cache_hit_rate" in out:
        out["cache_hit_rate"] = out.get("cache_hit_tokens_total", 0) / prompt if prompt else 0.0
    if "kv_transfer" in out:  # PD: every replica's KV manager measures its own rooms
        out["kv_transfer"] = merge_transfer_stats([s.get("kv_transfer") for s in stats])
    for rank, s in enumerate(stats):  # per-replica gauges too: /metrics labels by name suffix
        for k in ("num_running_reqs", "num_waiting_reqs", "num_pages_used", "num_pages_free"):
            if isinstance(s.get(k), int):
                out[f"dp{rank}_{k}"] = s[k]
    return out


def merge_transfer_stats(snaps: list[Any]) -> dict[str, Any]:
    """One server's KV-transfer measurements (stats key `kv_transfer`, the KV manager's
    pdcore.disagg.transfer_stats snapshot) from its DP replicas': histograms, totals,
    failures and rooms add up; `last` is the replica whose last transfer moved the most."""
    snaps = [s for s in snaps if isinstance(s, dict) and s]
    if not snaps:
        return {}
    out: dict[str, Any] = {"backend": snaps[0].get("backend", ""), "hist": {}, "totals": {},
                           "failures": [], "rooms": {},
                           "last": max((s.get("last", {}) for s in snaps),
                                       key=lambda last: last.get("total_mb", 0.0))}
    failures: Counter[tuple[str, str]] = Counter()
    for s in snaps:
        for name, h in s.get("hist", {}).items():
            m = out["hist"].setdefault(name, {"bounds": h["bounds"],
                                              "counts": [0] * len(h["counts"]), "sum": 0.0})
            m["counts"] = [a + b for a, b in zip(m["counts"], h["counts"])]
            m["sum"] += h["sum"]
        for key in ("totals", "rooms"):
            for k, v in s.get(key, {}).items():
                out[key][k] = out[key].get(k, 0) + v
        for phase, why, n in s.get("failures", []):
            failures[(phase, why)] += n
    out["failures"] = [[p, why, n] for (p, why), n in failures.items()]
    return out
