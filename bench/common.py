"""Shared helpers for the engine / serving / PD benchmarks: machine info, percentiles, result
JSON and plots, CPU pinning of server processes, and starting unified or 1P1D servers.

Pinning: a child inherits its parent's CPU affinity at fork, so `pinned(cpus)` narrows this
process's affinity just around the spawn of a server (its scheduler child, started later by the
server, inherits it from there); `tree_affinity(pid)` reads back what every process of the tree
actually got, so a result records the pinning it ran under instead of assuming it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# -- statistics --------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in [0, 100]); NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    xs = list(values)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def alternating(systems: Sequence[str], rep: int) -> list[str]:
    """Run order for repetition `rep`: A,B,C then C,B,A, ... so no system always goes first
    (a drifting machine load then biases neither side)."""
    return list(systems) if rep % 2 == 0 else list(reversed(systems))


# -- machine and results -----------------------------------------------------------------------
def cpu_model() -> tuple[str, list[str]]:
    """(the CPU's model name, which of the flags that decide the engine's kernels it has):
    results differ by CPU (AMX or not), and sessions land on different ones."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    return name, [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni",
                              "avx_vnni", "amx_int8") if f in flags]


ISA_CAP_ENVS = ("PDCORE_CPU_ISA", "PDCORE_NATIVE_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def isa_caps() -> dict[str, str]:
    """The variables that run this CPU as a lesser one (set in this process, children inherit
    them): a capped result names its cap, an uncapped one has {}."""
    return {k: os.environ[k] for k in ISA_CAP_ENVS if os.environ.get(k)}


def machine_info() -> dict[str, Any]:
    import torch

    model, flags = cpu_model()
    return {
        "cpu": model, "cpu_flags": flags, "isa_caps": isa_caps(),
        "nproc": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
        "loadavg": list(os.getloadavg()), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "nice": os.getpriority(os.PRIO_PROCESS, 0), "autogroup": _autogroup(),
    }


def _autogroup() -> str | None:
    """This session's scheduling group and its nice ("/autogroup-12 nice -10"), None without
    autogroups: with them a process's own nice only ranks it inside its session, so a timing
    run is boosted against other sessions only by its group's nice (servers the bench starts
    get this session's nice for theirs: pdcore.runtime.lifeline.carry_nice)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() != "1":
                return None
        with open("/proc/self/autogroup") as f:
            return f.read().strip()
    except OSError:
        return None


class Run:
    """Config + machine info at start; `finish()` adds the end load average and writes JSON."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name, self.config = name, config
        self.machine_start = machine_info()
        self.t0 = time.time()

    def finish(self, data: dict[str, Any], out_dir: Path | None = None) -> Path:
        out_dir = out_dir or RESULTS
        out_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "name": self.name, "config": self.config,
            "machine": {**self.machine_start, "loadavg_start": self.machine_start["loadavg"],
                        "loadavg_end": list(os.getloadavg()),
                        "wall_s": round(time.time() - self.t0, 1)},
            **data,
        }
        path = out_dir / f"{self.name}.json"
        path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")
        return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def load_note(run: Run) -> str:
    a, b = run.machine_start["loadavg"][0], os.getloadavg()[0]
    return f"load avg {a:.1f} -> {b:.1f} on {os.cpu_count()} CPUs"


def figure(ncols: int, width: float = 5.0, height: float = 4.0) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def save_figure(fig: Any, name: str, out_dir: Path | None = None) -> Path:
    import matplotlib.pyplot as plt

    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_groups(ax: Any, groups: Sequence[str], series: dict[str, Sequence[float]],
               ylabel: str, title: str, errors: dict[str, Sequence[tuple[float, float]]] | None
               = None) -> None:
    """Grouped bars: one group per label in `groups`, one bar per series; optional (lo, hi)
    whiskers per bar (e.g. min/max over repetitions)."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        yerr = None
        if errors and label in errors:
            yerr = [[max(0.0, v - lo) for v, (lo, _) in zip(vals, errors[label])],
                    [max(0.0, hi - v) for v, (_, hi) in zip(vals, errors[label])]]
        ax.bar(xs, vals, width, label=label, yerr=yerr, capsize=3)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median wall seconds of `reps` calls after one warm-up."""
    fn()
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def prefill_timer(eng: Any, rng: Any) -> Callable[[int], float]:
    """A function timing one prompt of n random token ids through an in-process LLMEngine
    `eng` (1 new token, greedy): the prompt's prefill, in seconds."""
    from pdcore.messages.io import SamplingParams

    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill(n: int) -> float:
        ps = [[rng.randrange(100, 40000) for _ in range(n)]]
        t = time.perf_counter()
        eng.generate(ps, sp)
        return time.perf_counter() - t
    return prefill


def timed_map(fn: Callable[[Any], Any], items: Sequence[Any], concurrency: int) -> tuple[float, list[Any]]:
    """fn over items on `concurrency` client threads: (wall seconds, results in order)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        out = list(ex.map(fn, items))
    return time.perf_counter() - t0, out


def medians_and_speedup(rows: dict[str, dict[str, Any]], base: str, other: str) -> None:
    """Each row's `tok_s` lists (one per round, per system) -> `median_tok_s` and `speedup`
    (other / base), in place."""
    for row in rows.values():
        med = {k: statistics.median(v) for k, v in row["tok_s"].items()}
        row["median_tok_s"], row["speedup"] = med, med[other] / med[base]


def speedup_bars(rows: dict[str, dict[str, Any]], base: str, other: str, title: str, name: str,
                 note: Callable[[dict[str, Any]], str] = lambda row: "",
                 width: float = 10.0) -> Path:
    """Two bars per row (base grey, other green: median output tok/s), the speedup (and
    `note(row)`) above each pair; saved as `name`."""
    fig, axes = figure(1, width=width)
    ax, keys = axes[0], list(rows)
    for off, system, color in ((-0.2, base, "#888"), (0.2, other, "#3a7")):
        ax.bar([i + off for i in range(len(keys))],
               [rows[k]["median_tok_s"][system] for k in keys], 0.4, label=system, color=color)
    for i, k in enumerate(keys):
        ax.text(i, max(rows[k]["median_tok_s"].values()),
                f"{rows[k]['speedup']:.2f}x{note(rows[k])}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel("output tok/s (median of rounds)")
    ax.set_ylim(0, 1.15 * max(max(r["median_tok_s"].values()) for r in rows.values()))
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, name)


# -- pinning -----------------------------------------------------------------------------------
def parse_cpus(spec: str) -> set[int]:
    """'0,1' or '0-3' or '0,2-3' -> {0, 1, ...} (taskset's list syntax)."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Narrow this process's CPU affinity while children are spawned (like `taskset -c`)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def thread_env(threads: int | None, wait_policy: str | None = None) -> dict[str, str]:
    """torch reads OMP_NUM_THREADS (intra-op threads) at import; MKL its own variable.
    `wait_policy` PASSIVE makes idle OpenMP threads sleep instead of spinning: on a shared,
    oversubscribed machine a spinning team member whose partner lost its core turns every
    small op into a wait for the scheduler (measured here: a 4-sequence decode step of SmolLM2
    took 340-1650 ms with 2 spinning threads, 120-140 ms with PASSIVE or with 1 thread)."""
    env = {"OMP_WAIT_POLICY": wait_policy} if wait_policy else {}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_affinity(pid: int) -> list[dict[str, Any]]:
    """For pid and all descendants: allowed CPUs, thread count and command (from /proc)."""
    rows, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        rows.append({"pid": p, "cpus": fields.get("Cpus_allowed_list", "?").strip(),
                     "threads": int(fields.get("Threads", "0")), "cmd": cmd})
        todo += _children(p)
    return rows


def cpu_by_process(pid: int) -> dict[int, float]:
    """User + system CPU seconds of pid and each descendant (from /proc/<pid>/stat)."""
    out, todo = {}, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        parts = stat[stat.rindex(")") + 2:].split()
        out[p] = (int(parts[11]) + int(parts[12])) / tick
        todo += _children(p)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of pid and its descendants."""
    return sum(cpu_by_process(pid).values())


# -- servers ---------------------------------------------------------------------------------
def start_unified(model_path: str | None, flags: Sequence[str] = (), cpus: set[int] | None = None,
                  threads: int | None = None, timeout: float = 600.0, wait: bool = True,
                  wait_policy: str | None = None, env: dict[str, str] | None = None) -> Any:
    """A unified `pdserve serve` on loopback, pinned to `cpus` with `threads` torch threads,
    `env` added to its environment (`wait=False`: spawned only; call `.wait_healthy()`)."""
    from pdcore.testing.processes import ServerProcess

    extra = ("--model-path", model_path) if model_path else ()
    with pinned(cpus):
        server = ServerProcess(*extra, *flags,
                               env={**thread_env(threads, wait_policy), **(env or {})})
    return server.wait_healthy(timeout) if wait else server


def start_pd(model_path: str | None, backend: str, flags: Sequence[str] = (),
             p_cpus: set[int] | None = None, d_cpus: set[int] | None = None,
             threads: int | None = None, timeout: float = 600.0, wait: bool = True,
             wait_policy: str | None = None) -> Any:
    """1P1D + our router (round robin): P and D each pinned to their own CPUs with `threads`
    torch threads; the router (asyncio proxy, no model) is not pinned. `wait=False`: P and D
    spawned only; `.start()` waits for them and starts the router."""
    from pdcore.testing.processes import PDCluster, ServerProcess, free_port

    common = ("--disaggregation-transfer-backend", backend, *flags)
    if model_path:
        common += ("--model-path", model_path)
    env = thread_env(threads, wait_policy)
    cluster = PDCluster(backend, prefill=0, decode=0, env=env)
    try:
        bport = free_port()
        with pinned(p_cpus):
            cluster.prefills.append(ServerProcess(
                *common, "--disaggregation-mode", "prefill",
                "--disaggregation-bootstrap-port", str(bport), env=env))
        cluster.bootstrap_ports.append(bport)
        with pinned(d_cpus):
            cluster.decodes.append(ServerProcess(*common, "--disaggregation-mode", "decode",
                                                 env=env))
        if wait:
            cluster.start(timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster
