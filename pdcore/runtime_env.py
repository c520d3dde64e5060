"""Process-wide runtime defaults that must be set before torch (and its OpenMP) loads, and where
a server's compute threads run (its CPU placement).

OpenMP's default wait policy spins idle threads. When more compute threads than free cores exist
(prefill, decode and router processes on one box, or any busy machine) the spinning threads
starve the ones doing work: measured here, 48 decode steps of SmolLM2 took 110 s with the
default policy and 5.6 s with PASSIVE on the same loaded 2-core machine. Entry points call
`apply()` first; a value the user set wins. On cores a server has to itself, a bounded spin
(GOMP_SPINCOUNT=30000, which overrides PASSIVE's zero spin) served about 1.25x the tokens/s of
PASSIVE here: a decode step is ~100 OpenMP regions per layer pass, and waking a sleeping thread
for each costs more than the region.

Placement (`--cpu-omp-threads-bind`, else PDSERVE_CPU_OMP_THREADS_BIND, else `auto`):
- a CPU list (`0-1`, `2,3`): the engine process is bound to those CPUs, one OpenMP thread per
  CPU pinned in order, bounded spin: the server owns them;
- `auto`: the same over every CPU this process may run on, unless the user set OMP_NUM_THREADS
  (then they share the box out themselves: their thread count, no binding, passive wait);
- `all` / `nobind`: no binding, passive wait (the cores are shared with other servers).
The engine (scheduler) process is spawned with the placement's environment and affinity, so
OpenMP reads them when torch first starts its thread pool there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pdcore.env import ENV, Env, put

# oneDNN caches a primitive per GEMM shape (1024 by default); every new prefill length adds
# some, and on SmolLM2 they held about 75 MiB after a few concurrent requests. A decode step at a
# fixed batch needs a handful, so 64 keeps every hot one and the server within #21's memory bound.
DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
BIND_ENV = Env.pdserve_cpu_omp_threads_bind.name
# keys apply() set (not the user): children of ours inherit them, and must not read them as the
# user's choice
DEFAULTED_ENV = Env.pdserve_env_defaulted.name
SPIN_COUNT = "30000"
NO_BIND = ("all", "nobind")


class PlacementError(ValueError):
    """A --cpu-omp-threads-bind value that cannot be used (the CLI turns it into exit 2)."""


# PDCORE_CPU_ISA: run as on a CPU with less than this one has (tests and benchmarks of the paths
# other hosts take, on this one). torch's kernels (ATEN_CPU_CAPABILITY), oneDNN's
# (ONEDNN_MAX_CPU_ISA), our native kernels (engine/native: avx512_allowed) and the bf16 decision
# (engine/cpu_features) all follow it: `avx2` is an AVX2-only CPU (AMD Zen 2: no AVX-512, no
# bf16 hardware), `avx512` an AVX-512 one with BF16 but no AMX (AMD Zen 4).
ISA_ENV = Env.pdcore_cpu_isa.name
ISA_ENVS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}


def forced_isa(env: Mapping[str, str] | None = None) -> str:
    """'' (this CPU as it is), 'avx2' or 'avx512'; EnvError (a ValueError) for anything else."""
    return Env(env).pdcore_cpu_isa


def apply() -> None:
    ours = set(filter(None, ENV.pdserve_env_defaulted.split(",")))
    try:
        isa = forced_isa()
    except ValueError:
        isa = ""  # the server's argument check says so (cpu_features.check_cpu_dtype)
    wanted = {**DEFAULTS, **ISA_ENVS.get(isa, {})}
    fresh = {key: value for key, value in wanted.items() if not ENV.is_set(key)}
    ours.update(fresh)
    put({**fresh, DEFAULTED_ENV: ",".join(sorted(ours))})


def user_set(key: str, env: Mapping[str, str] | None = None) -> bool:
    """True when `key` is in the environment and was not put there by apply()."""
    e = Env(env)
    return e.is_set(key) and key not in e.pdserve_env_defaulted.split(",")


def available_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_cpus(spec: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; PlacementError on anything else."""
    cpus: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if hi else int(lo)
            if a < 0 or b < a:
                raise ValueError
            cpus.extend(c for c in range(a, b + 1) if c not in cpus)
    except ValueError:
        raise PlacementError(f"--cpu-omp-threads-bind {spec!r}: expected auto, all, nobind or a "
                          "CPU list such as 0-1 or 0,2") from None
    return cpus


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...] | None  # bound to these (one pinned thread each); None: not bound
    threads: int | None  # OpenMP threads; None: leave torch's choice (or the user's)
    spin: bool  # bounded spin (owns its cores) or passive wait (shares them)
    why: str
    pin_threads: bool = True  # one OpenMP thread per CPU in order (one engine process only)

    def env(self) -> dict[str, str | None]:
        """Variables the engine process gets (None: remove ours). Keys the user set are kept."""
        out: dict[str, str | None] = {}
        if self.spin:
            out["GOMP_SPINCOUNT"] = SPIN_COUNT
            out["OMP_WAIT_POLICY"] = None  # our PASSIVE default goes; the spin count bounds it
        else:
            out["OMP_WAIT_POLICY"] = "PASSIVE"
        if self.threads is not None:
            out["OMP_NUM_THREADS"] = str(self.threads)
        if self.cpus is not None and self.pin_threads:
            out["OMP_PROC_BIND"] = "close"
            out["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in self.cpus)
        return {k: v for k, v in out.items() if not user_set(k)}

    def describe(self) -> str:
        where = (f"CPUs {format_cpus(self.cpus)}" if self.cpus is not None else "not bound")
        wait = "bounded spin" if self.spin else "passive wait"
        if self.spin and user_set("OMP_WAIT_POLICY"):  # the user's policy wins over the spin
            wait = f"OMP_WAIT_POLICY={ENV.raw('OMP_WAIT_POLICY')} (set by you)"
        threads = f"{self.threads} OpenMP threads" if self.threads else "default threads"
        return f"{where}, {threads}, {wait} ({self.why})"


def format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def bind_spec(flag: str | None) -> str:
    return (flag or ENV.pdserve_cpu_omp_threads_bind).strip()


def choose_placement(flag: str | None, replicas: int = 1) -> Placement:
    """The engine's placement from the flag / variable (see the module docstring). `replicas`
    engine processes of one server (DP replicas, TP ranks on a host) share its CPUs: not bound
    unless a list is given, and then each process may use the whole list (threads unpinned:
    every process would pin its first thread to the list's first CPU)."""
    spec = bind_spec(flag)
    avail = available_cpus()
    if spec in NO_BIND:
        return Placement(None, None, False, f"{spec}: cores shared with other processes")
    if spec == "auto":
        if user_set("OMP_NUM_THREADS"):
            return Placement(None, None, False, "auto: OMP_NUM_THREADS is set, so the cores "
                             "are shared out by hand")
        if replicas > 1:
            return Placement(None, None, False, f"auto: {replicas} engine processes share "
                             "the cores")
        return Placement(tuple(avail), len(avail), True,
                         "auto: every CPU this process may use, owned by this server")
    cpus = parse_cpus(spec)
    missing = [c for c in cpus if c not in avail]
    if missing:
        raise PlacementError(f"--cpu-omp-threads-bind {spec}: CPU {format_cpus(missing)} is not "
                          f"available to this process (available: {format_cpus(avail)})")
    if replicas > 1:
        return Placement(tuple(cpus), None, True, f"{spec}: given, shared by {replicas} engine "
                         "processes", pin_threads=False)
    return Placement(tuple(cpus), len(cpus), True, f"{spec}: given, owned by this server")


@contextmanager
def spawning_with(p: Placement) -> Iterator[None]:
    """Within the block, processes this thread starts get the placement's environment and CPU
    affinity (a child inherits both from the thread that starts it); both are restored after."""
    env = p.env()
    saved_env = {k: ENV.raw(k) for k in env}
    before = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    try:
        put(env)
        if p.cpus is not None and before is not None:
            os.sched_setaffinity(0, p.cpus)
        yield
    finally:
        if p.cpus is not None and before is not None:
            os.sched_setaffinity(0, before)
        put(saved_env)


def server_threads(n_servers: int) -> int | None:
    """OpenMP threads per server when `up` runs n_servers engines on this host: the CPUs shared
    out (at least 1), so the engines' thread teams do not oversubscribe the cores (an OpenMP
    team waits at every barrier for its slowest thread; a descheduled one stalls them all).
    None when the user set OMP_NUM_THREADS: theirs is kept."""
    if user_set("OMP_NUM_THREADS"):
        return None
    return max(1, len(available_cpus()) // max(1, n_servers))


def disjoint_cpus(n_servers: int) -> list[str] | None:
    """One CPU list per server, disjoint and as even as the CPUs allow, or None when there are
    fewer CPUs than servers (or the user set OMP_NUM_THREADS: they share the box out)."""
    cpus = available_cpus()
    if n_servers < 1 or len(cpus) < n_servers or user_set("OMP_NUM_THREADS"):
        return None
    out = []
    for i in range(n_servers):
        a, b = i * len(cpus) // n_servers, (i + 1) * len(cpus) // n_servers
        out.append(format_cpus(cpus[a:b]))
    return out


_LIBC: list = []  # the loaded C library, found once (find_library runs a helper program)
# glibc's mallopt parameters and the variables by which a user sets them instead
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit
TRIM_THRESHOLD = 2**30


def _libc() -> Any:  # a ctypes.CDLL, or None where there is no C library to load
    import ctypes
    import ctypes.util

    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(ctypes.util.find_library("c")))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def hold_heap() -> bool:
    """Keep the memory a forward pass frees for the next one, instead of handing it back to the
    OS after every step (an engine process calls this once, after loading).

    glibc serves each large block (a prefill's activations: 1024 tokens x SmolLM2's MLP width is
    6 MiB) with a fresh mmap, or trims the heap top after the free, so every step page-faults
    and zero-fills its activations again: measured on SmolLM2, a 1024-token prefill took 1.42 s
    with the heap held against 1.56-1.84 s without, and an MLP block 19 ms against 30 ms. Blocks
    up to 32 MiB come from the heap and up to 1 GiB of free heap stays mapped; `trim_heap` (run
    when the server goes idle) still hands it all back, so the resident size at rest is as
    before. A user's MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ / GLIBC_TUNABLES win (then
    nothing is changed). False where not applied."""
    if any(user_set(k) for k in HEAP_ENV):
        return False
    libc = _libc()
    try:
        return (libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    except (AttributeError, TypeError):  # not glibc
        return False


def trim_heap() -> None:
    """Hand the heap this process freed (after loading weights, after a busy spell of steps)
    back to the OS: glibc keeps freed chunks for reuse otherwise, and they stay resident."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except (AttributeError, TypeError):  # not glibc: nothing to trim
        pass
