"""Process-wide runtime defaults that must be set before torch (and its OpenMP) loads.

OpenMP's default wait policy spins idle threads. When more compute threads than free cores exist
(prefill, decode and router processes on one box, or any busy machine) the spinning threads
starve the ones doing work: measured here, 48 decode steps of SmolLM2 took 110 s with the
default policy and 5.6 s with PASSIVE on the same loaded 2-core machine. Entry points call
`apply()` first; a value the user set wins. On cores a server has to itself, a bounded spin
(GOMP_SPINCOUNT=30000, which overrides PASSIVE's zero spin) served about 1.25x the tokens/s of
PASSIVE here; the README gives the numbers.
"""

from __future__ import annotations

import os

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


def server_threads(n_servers: int) -> int | None:
    """OpenMP threads per server when `up` runs n_servers engines on this host: the CPUs shared
    out (at least 1), so the engines' thread teams do not oversubscribe the cores (an OpenMP
    team waits at every barrier for its slowest thread; a descheduled one stalls them all).
    None when the user set OMP_NUM_THREADS: theirs is kept."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)
    return max(1, cpus // max(1, n_servers))
