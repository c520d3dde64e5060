"""How DP replicas' KV-transfer measurements (pdcore.disagg.transfer_stats snapshots) add up
into one server's; the rest of their reports merge in StatsReport.merge
(pdcore.messages.stats)."""

from __future__ import annotations

from collections import Counter
from typing import Any


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
