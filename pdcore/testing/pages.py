"""The page invariant tests check after every run: each KV page is free or held by the prefix
cache alone, none by a request (live or dead)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def pages_at_rest(sched: Any) -> bool:
    """A Scheduler whose pool holds nothing but free pages and unreferenced cached ones."""
    from pdcore.engine.sched.runtime_api import RuntimeAPI

    return RuntimeAPI(sched).pages_at_rest()


def load_at_rest(load: Mapping[str, Any]) -> bool:
    """The same from a server's /get_load (or stats) entry."""
    return (load["num_pages_free"] + load.get("radix_cache_evictable_pages", 0)
            == load["num_pages_total"])
