"""When the engine's OpenMP thread team shrinks off a core a neighbour takes, and when it grows
back (#47 item 5). Pure decisions over measured windows, so recorded samples test them;
`runtime/cpu_team.py` measures (/proc) and applies them.

Why: a team of pinned threads waits at every parallel region's barrier for its slowest thread,
so a thread whose core another busy process takes half of stalls the whole team (2 cores, a
busy process pinned on one: 0.52x of the tokens/s alone with 2 threads; 1 thread on the free
core: 0.79x).

Each window (about half a second of steps) says, for every configured core: its *contention*,
the share of the runnable time of the team's thread there spent waiting for the core (the
kernel's run delay; None when the core is not in the team or its thread was too seldom
runnable to tell: then the core's busy share stands for it as the least contested core), and
its idle share (/proc/stat).
- shrink: a core whose contention is at least `shrink_at` and `margin` above the least contested
  team core's, `strikes` windows in a row, leaves the team. The least contested core never
  qualifies, so the team never drops below one thread; evenly loaded cores keep the team whole.
- grow: a dropped core comes back when it was idle at least `idle_grow` of `strikes` windows in
  a row (its neighbour left), or as a probe once its backoff has passed (`probe_first_s`,
  doubled, up to `probe_max_s`, each time a core that came back is found contested again in its
  first window: one contested window drops it then). The team never exceeds the configured cores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SHRINK_AT = 0.3
MARGIN = 0.2
STRIKES = 2
IDLE_GROW = 0.5
PROBE_FIRST_S = 5.0
PROBE_MAX_S = 80.0


@dataclass(frozen=True)
class CoreSample:
    contention: float | None  # wait / (run + wait) of the team's thread on the core
    idle: float  # the core's idle share of the window


@dataclass(frozen=True)
class Change:
    cpus: tuple[int, ...]  # the new team, in the configured order
    kind: str  # "shrink", "grow", "probe" or "probe failed"
    why: str


@dataclass
class _Dropped:
    since: float
    backoff: float  # seconds before a probe
    idle_windows: int = 0


class TeamPolicy:
    """The team's cores, changed by `decide` one window at a time."""

    def __init__(self, cpus: Sequence[int], *, shrink_at: float = SHRINK_AT, margin: float = MARGIN,
                 strikes: int = STRIKES, idle_grow: float = IDLE_GROW,
                 probe_first_s: float = PROBE_FIRST_S, probe_max_s: float = PROBE_MAX_S) -> None:
        if not cpus or margin <= 0 or strikes < 1:
            raise ValueError("a team needs at least one CPU, a positive margin and strikes >= 1")
        self.cpus = tuple(cpus)
        self.active = tuple(cpus)
        self.shrink_at, self.margin, self.strikes = shrink_at, margin, strikes
        self.idle_grow, self.probe_first_s, self.probe_max_s = idle_grow, probe_first_s, probe_max_s
        self.dropped: dict[int, _Dropped] = {}
        self.probing: dict[int, float] = {}  # a core back on trial -> its backoff so far
        self.bad_windows: dict[int, int] = {}

    def decide(self, now: float, samples: Mapping[int, CoreSample]) -> Change | None:
        """The change this window calls for (already made to `active`), or None."""
        return self._shrink(now, samples) or self._grow(now, samples)

    def _shrink(self, now: float, samples: Mapping[int, CoreSample]) -> Change | None:
        known = {c: v for c in self.active
                 if c in samples and (v := samples[c].contention) is not None}
        if not known:
            return None
        # a team core whose thread was too seldom runnable to tell counts as contested as the
        # core is busy: an idle one is a free core the others are measured against
        floor = min([*known.values(), *(1.0 - samples[c].idle for c in self.active
                                        if c in samples and c not in known)])
        out: list[int] = []
        for c, v in known.items():
            bad = v >= self.shrink_at and v >= floor + self.margin
            if c in self.probing:  # its first window back decides
                if bad:
                    out.append(c)
                else:
                    del self.probing[c]
                continue
            self.bad_windows[c] = self.bad_windows.get(c, 0) + 1 if bad else 0
            if self.bad_windows[c] >= self.strikes:
                out.append(c)
        if not out:
            return None
        probes = all(c in self.probing for c in out)
        for c in out:
            before = self.probing.pop(c, None)
            backoff = self.probe_first_s if before is None else min(before * 2, self.probe_max_s)
            self.dropped[c] = _Dropped(now, backoff)
        self.active = tuple(c for c in self.active if c not in out)
        self.bad_windows.clear()
        why = "; ".join(f"CPU {c}: our thread waited {known[c]:.0%} of its runnable time"
                        for c in out) + f" (least contested core: {floor:.0%})"
        return Change(self.active, "probe failed" if probes else "shrink", why)

    def _grow(self, now: float, samples: Mapping[int, CoreSample]) -> Change | None:
        back: list[int] = []
        probes: list[int] = []
        for c, d in self.dropped.items():
            s = samples.get(c)
            d.idle_windows = d.idle_windows + 1 if s is not None and s.idle >= self.idle_grow else 0
            if d.idle_windows >= self.strikes:
                back.append(c)
            elif now - d.since >= d.backoff:
                probes.append(c)
        if not back and not probes:
            return None
        for c in back + probes:
            self.probing[c] = self.dropped.pop(c).backoff
        self.active = tuple(c for c in self.cpus if c in self.active or c in back or c in probes)
        self.bad_windows.clear()
        parts = []
        if back:
            parts.append(f"CPU {','.join(map(str, back))} idle again")
        if probes:
            parts.append(f"probing CPU {','.join(map(str, probes))} after its "
                         f"{self.probing[probes[0]]:.0f} s backoff")
        return Change(self.active, "grow" if back else "probe", "; ".join(parts))
