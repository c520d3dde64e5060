"""The scheduler process's OpenMP thread team, adapted at run time to busy neighbours on its
cores (#47 item 5; when: runtime/team_policy.py).

The team exists as placed by runtime_env (`auto` or a CPU list: one OpenMP thread pinned per
CPU through OMP_PLACES, the scheduler's thread being thread 0). Every window (WINDOW_S of
steps) the loop's `tick` reads each team thread's run and run-delay times
(/proc/self/task/<tid>/schedstat) and each core's idle time (/proc/stat; a niced process's time
counts as idle for a server that is not niced), and a change from the
policy is applied between steps: torch.set_num_threads(k) (the torch operators and the native
kernels' at::parallel_for read it at each call) and each of the k threads pinned to one of the
chosen cores (libgomp keeps handing team slot i to the same pool thread, whose binding it set
once; ours replaces it). Off (stats say so, the log says why) with PDSERVE_CPU_TEAM_ADAPT=0,
unpinned placements (`nobind`, OMP_NUM_THREADS set by you, several engine processes), a team
of one, or where /proc lacks what it reads. Cost: a few small /proc reads per window.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdcore.env import ENV
from pdcore.runtime.team_policy import Change, CoreSample, TeamPolicy

log = logging.getLogger("pdcore.cpu_team")

WINDOW_S = 0.5
MIN_RUNNABLE = 0.05  # a thread runnable less than this share of a window tells nothing
FIND_TRIES = 20  # windows to find the pool's threads in before giving up


def pinned_cpus() -> tuple[int, ...] | None:
    """The CPUs of this process's pinned team, one OpenMP thread each (OMP_PLACES `{0},{1}` with
    OMP_PROC_BIND set, as runtime_env's placement puts them), or None."""
    bind, places = ENV.raw("OMP_PROC_BIND"), ENV.raw("OMP_PLACES")
    if not bind or bind.strip().lower() == "false" or not places:
        return None
    cpus = []
    for part in places.split(","):
        part = part.strip()
        if not (part.startswith("{") and part.endswith("}") and part[1:-1].isdigit()):
            return None
        cpus.append(int(part[1:-1]))
    return tuple(cpus) if len(set(cpus)) == len(cpus) else None


def _schedstat(tid: int) -> tuple[int, int]:
    """(ns on a CPU, ns waiting for one) of a thread of this process."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait = f.read().split()[:2]
    return int(run), int(wait)


def _cpu_times(niced_free: bool) -> dict[int, tuple[int, int]]:
    """cpu -> (free ticks, all ticks) from /proc/stat: idle and iowait, and with `niced_free`
    the time of niced processes (nice > 0), which yield a core to a thread of nice <= 0."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3:4].isdigit():
                name, *vals = line.split()
                ticks = [int(v) for v in vals[:8]]  # guest time is in user's already
                free = ticks[3] + ticks[4] + (ticks[1] if niced_free else 0)
                out[int(name[3:])] = (free, sum(ticks))
    return out


@dataclass
class _Snapshot:
    t: float
    threads: dict[int, tuple[int, int]]  # team slot -> schedstat
    cpus: dict[int, tuple[int, int]]


class CpuTeam:
    """Measures the team each window and applies the policy's changes (`tick`, from the
    scheduler's own thread: the OpenMP master)."""

    def __init__(self, cpus: tuple[int, ...] | None, why_off: str = "",
                 set_threads: Callable[[int], None] | None = None,
                 window_s: float = WINDOW_S, threads: int = 1) -> None:
        self.on = cpus is not None and len(cpus) > 1
        self.threads = threads  # the team's size when it is not adapted
        self.why_off = why_off or ("" if self.on else "a team of one thread")
        self.policy = TeamPolicy(cpus or (0,))
        self.master = threading.get_native_id()
        self.workers: dict[int, int] | None = None  # team slot (>= 1) -> thread id
        self.set_threads = set_threads
        self.window_s = window_s
        self.window: _Snapshot | None = None
        self.tries = 0
        self.changes = self.probes = 0
        self.last: dict[int, CoreSample] = {}  # the last window's samples

    @classmethod
    def start(cls, device: str, threads: int, set_threads: Callable[[int], None]) -> CpuTeam:
        """The team of this process (`threads`: torch's count now), adapted or not."""
        why = ""
        cpus = pinned_cpus()
        if not ENV.pdserve_cpu_team_adapt:
            why = "PDSERVE_CPU_TEAM_ADAPT=0"
        elif device != "cpu":
            why = f"device {device}"
        elif cpus is None:
            why = "threads not pinned (placement nobind, OMP_NUM_THREADS set, or several engines)"
        elif threads != len(cpus):
            why = f"{threads} threads on {len(cpus)} places"
        elif not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
            why = "no /proc/<tid>/schedstat"
        team = cls(None if why else cpus, why, set_threads, threads=threads)
        if team.on:
            log.info("CPU team: %d threads on CPUs %s, adapted to busy neighbours "
                     "(PDSERVE_CPU_TEAM_ADAPT=0: off)", len(team.policy.cpus),
                     ",".join(map(str, team.policy.cpus)))
        else:
            log.info("CPU team: not adapted at run time (%s)", team.why_off)
        return team

    def stats(self) -> dict[str, float]:
        """The team's gauges and counters; per configured CPU the last window's contention of
        the team's thread there (-1: not in the team, or too seldom runnable to tell)."""
        out: dict[str, float] = {
            "cpu_team_adaptive": int(self.on), "cpu_team_threads":
            len(self.policy.active) if self.on else self.threads,
            "cpu_team_changes_total": self.changes, "cpu_team_probes_total": self.probes}
        for c, s in self.last.items():
            out[f"cpu_team_contention_cpu{c}"] = -1.0 if s.contention is None else s.contention
        return out

    def _off(self, why: str) -> None:
        self.on, self.why_off = False, why
        log.warning("CPU team: no longer adapted (%s)", why)

    def _find_workers(self) -> bool:
        """The pool threads libgomp bound to the team's CPUs after the first (slot 1 on the
        second CPU, ...): tasks bound to exactly that CPU. The scheduler's own threads that
        started after torch inherited thread 0's binding, so they never match."""
        cpus = self.policy.cpus
        found: dict[int, list[int]] = {}
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            try:
                aff = os.sched_getaffinity(tid)
            except OSError:
                continue
            if tid != self.master and len(aff) == 1 and (c := next(iter(aff))) in cpus[1:]:
                found.setdefault(cpus.index(c), []).append(tid)
        if all(len(found.get(i, [])) == 1 for i in range(1, len(cpus))):
            self.workers = {i: tids[0] for i, tids in found.items()}
            return True
        self.tries += 1
        if self.tries >= FIND_TRIES:
            self._off(f"OpenMP's threads not found bound one per CPU (found {found})")
        return False

    def _tid(self, slot: int) -> int:
        return self.master if slot == 0 else self.workers[slot]  # type: ignore[index]

    def _snapshot(self, now: float) -> _Snapshot:
        threads = {i: _schedstat(self._tid(i)) for i in range(len(self.policy.active))}
        niced_free = os.getpriority(os.PRIO_PROCESS, 0) <= 0  # this thread's nice
        return _Snapshot(now, threads, _cpu_times(niced_free))

    def _samples(self, a: _Snapshot, b: _Snapshot) -> dict[int, CoreSample]:
        wall_ns = (b.t - a.t) * 1e9
        out = {}
        for c in self.policy.cpus:
            (idle0, all0), (idle1, all1) = a.cpus.get(c, (0, 0)), b.cpus.get(c, (0, 0))
            idle = (idle1 - idle0) / (all1 - all0) if all1 > all0 else 0.0
            contention = None
            if c in self.policy.active:
                slot = self.policy.active.index(c)
                run = b.threads[slot][0] - a.threads[slot][0]
                wait = b.threads[slot][1] - a.threads[slot][1]
                if run + wait >= MIN_RUNNABLE * wall_ns:
                    contention = wait / (run + wait)
            out[c] = CoreSample(contention, idle)
        return out

    def tick(self, stepping: bool, now: float | None = None) -> None:
        """After each loop iteration; `stepping`: it ran (or will run) steps, so the window
        counts. An idle spell starts a new window."""
        if not self.on:
            return
        now = time.monotonic() if now is None else now
        if not stepping:
            self.window = None
            return
        try:
            if self.workers is None and not self._find_workers():
                return
            if self.window is None:
                self.window = self._snapshot(now)
                return
            if now - self.window.t < self.window_s:
                return
            snap = self._snapshot(now)
            samples = self.last = self._samples(self.window, snap)
            log.debug("CPU team window: %s", {c: (s.contention, round(s.idle, 3))
                                               for c, s in samples.items()})
            before = len(self.policy.active)
            change = self.policy.decide(now, samples)
            if change is not None:
                self._apply(before, change)
                snap = self._snapshot(time.monotonic())
            self.window = snap
        except OSError as e:  # a thread gone, /proc unreadable: the team as placed
            self._off(f"{type(e).__name__}: {e}")
            self._restore()

    def _pin(self, cpus: tuple[int, ...]) -> None:
        if self.set_threads is not None:
            self.set_threads(len(cpus))
        for slot, c in enumerate(cpus):
            os.sched_setaffinity(0 if slot == 0 else self._tid(slot), {c})

    def _apply(self, before: int, change: Change) -> None:
        self._pin(change.cpus)
        self.changes += 1
        self.probes += change.kind == "probe"
        log.info("CPU team %s: %d -> %d threads, on CPUs %s (%s)", change.kind, before,
                 len(change.cpus), ",".join(map(str, change.cpus)), change.why)

    def _restore(self) -> None:
        try:
            self.policy.active = self.policy.cpus
            if self.workers is not None:
                self._pin(self.policy.cpus)
        except OSError:
            pass
