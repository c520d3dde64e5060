"""Is one server start's decode slower than another's, or is it the host? (#47's per-start
spread: session 7 saw 37 against 30 ms a step at 128 / 64 c8 from two starts of one build.)

K unified servers are started in a chain so that two are alive at once on different ports:
start 0 and 1, measure them alternately R rounds; stop 0, start 2, measure 1 and 2 alternately;
and so on. Each start is thus measured over two phases of its life, always side by side with a
neighbour, so host drift (VM neighbours, frequency, the CI) hits both sides of every pair. One
measurement is the median streamed TPOT of 8 concurrent /generate requests (64 tokens,
ignore_eos; tpot_floor.served_tpot), greedy and default sampling.

Analysis per case, on log TPOT: a two-way fit log t = start effect + slot effect (a slot is one
round of one phase, in which both alive servers were measured back to back), least squares. The
slot effects take the host's drift out; what is left per start is its own speed (`start_effect`,
in % around the mean) and the residual is the within-start noise once drift is out
(`residual_pct`). Reported next to the raw numbers: the spread of the per-start medians and the
spread within each start's own samples (drift included). A start effect well beyond the
residual noise is per start; if not, the spread is the host's.

Per start it also records what could differ: GEMM layouts and ISA and the CPU team (from
/metrics), and for the engine process its threads' allowed and last CPUs, RSS and thread count.

Run: `python bench/start_variance.py [--model-path DIR] [--starts 6] [--rounds 3] [--tag T]`;
JSON + PNG in bench/results/start_variance[_T].*.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure, start_unified
from tpot_floor import served_tpot

NAME = "start_variance"
CASES = ("greedy", "default")
BATCH = 8
METRIC_KEYS = ("gemm_weights_", "native_isa_", "cpu_team_")


def metrics(url: str) -> dict[str, float]:
    """The scheduler gauges that say how this start set itself up (layouts, ISA, team)."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("pdserve_scheduler_") and any(k in line for k in METRIC_KEYS):
            name, _, val = line.rpartition(" ")
            out[name.removeprefix("pdserve_scheduler_").split("{")[0]] = float(val)
    return out


def engine_threads(pid: int) -> dict[str, Any]:
    """For the server's engine (scheduler) process: per busy thread its name, allowed CPUs and
    the CPU it last ran on; the process's RSS and AnonHugePages."""
    from pdcore.testing.processes import spawned_children

    eng = spawned_children(pid)[0]
    rows = []
    for task in sorted(Path(f"/proc/{eng}/task").iterdir(), key=lambda t: int(t.name)):
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        allowed = next((ln.split(":\t")[1].strip() for ln in status.splitlines()
                        if ln.startswith("Cpus_allowed_list")), "?")
        rows.append({"tid": int(task.name), "comm": comm, "allowed": allowed,
                     "last_cpu": int(fields[36]), "utime": int(fields[11])})
    mem = dict(ln.split(":", 1) for ln in
               Path(f"/proc/{eng}/smaps_rollup").read_text().splitlines()[1:] if ":" in ln)
    busy = sorted(rows, key=lambda r: -r["utime"])[:4]  # the compute threads
    return {"pid": eng, "threads": len(rows), "rss_kib": int(mem["Rss"].split()[0]),
            "anon_huge_kib": int(mem["AnonHugePages"].split()[0]), "busiest": busy}


def fit(samples: list[tuple[int, int, float]], starts: int) -> dict[str, Any]:
    """log t = e_start + d_slot by least squares (sum of e = 0): per-start effects in %, and
    the residual standard deviation in % (within-start noise with the slots' drift out)."""
    import numpy as np

    slots = sorted({s for _, s, _ in samples})
    cols = starts + len(slots)
    a = np.zeros((len(samples) + 1, cols))
    y = np.zeros(len(samples) + 1)
    for i, (k, s, t) in enumerate(samples):
        a[i, k] = 1.0
        a[i, starts + slots.index(s)] = 1.0
        y[i] = math.log(t)
    a[-1, :starts] = 1.0  # constraint row: the start effects sum to 0
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y[:-1] - a[:-1] @ coef
    dof = max(1, len(samples) - (starts + len(slots) - 1))
    sd = math.sqrt(float(resid @ resid) / dof)
    eff = [(math.exp(c) - 1) * 100 for c in coef[:starts]]
    return {"start_effect_pct": [round(e, 2) for e in eff],
            "start_effect_sd_pct": round(statistics.pstdev(eff), 2),
            "start_effect_range_pct": round(max(eff) - min(eff), 2),
            "residual_pct": round(sd * 100, 2), "dof": dof}


def pair_ratios(samples: list[tuple[int, int, float]]) -> list[dict[str, Any]]:
    """Per phase (its two starts measured in the same slots): the median over its slots of the
    newer start's TPOT over the older's. A per-start effect shows as a start that is slow
    against both of its neighbours (ratio > 1 in one phase, < 1 in the next)."""
    phases: dict[tuple[int, int], list[float]] = {}
    slots: dict[int, dict[int, float]] = {}
    for k, s, t in samples:
        slots.setdefault(s, {})[k] = t
    for ts in slots.values():
        if len(ts) == 2:
            lo, hi = sorted(ts)
            phases.setdefault((lo, hi), []).append(ts[hi] / ts[lo])
    return [{"starts": list(p), "newer_over_older": round(statistics.median(v), 3),
             "per_slot": [round(x, 3) for x in v]} for p, v in sorted(phases.items())]


def spread(raw: dict[int, list[float]]) -> dict[str, float]:
    """Raw spreads, drift included: of the per-start medians, and within starts (each start's
    (max - min) / median, averaged; and the pooled sd in %)."""
    meds = [statistics.median(v) for v in raw.values() if v]
    within = [(max(v) - min(v)) / statistics.median(v) * 100 for v in raw.values() if len(v) > 1]
    pooled = [(x / statistics.fmean(v) - 1) for v in raw.values() if len(v) > 1 for x in v]
    return {"between_medians_range_pct": round((max(meds) - min(meds)) / statistics.median(meds)
                                               * 100, 2),
            "between_medians_sd_pct": round(statistics.pstdev(meds) / statistics.fmean(meds)
                                            * 100, 2),
            "within_range_pct_mean": round(statistics.fmean(within), 2) if within else math.nan,
            "within_sd_pct": round(math.sqrt(sum(p * p for p in pooled) / len(pooled)) * 100, 2)
            if pooled else math.nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--starts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per phase")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra server environment (repeatable)")
    ap.add_argument("--tag", default=None, help="results in start_variance_<tag>.json / .png")
    a = ap.parse_args()
    if a.starts < 2 or a.rounds < 1:
        ap.error("--starts >= 2 and --rounds >= 1")
    env = dict(kv.split("=", 1) for kv in a.env)
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, vars(a))
    raw: dict[str, dict[int, list[float]]] = {c: {k: [] for k in range(a.starts)} for c in CASES}
    samples: dict[str, list[tuple[int, int, float]]] = {c: [] for c in CASES}
    info: dict[int, dict[str, Any]] = {}
    alive: dict[int, Any] = {}
    slot = 0
    try:
        for k in range(a.starts):
            alive[k] = start_unified(a.model_path, env=env)
            served_tpot(alive[k].url, 2, rounds=1)  # warm-up
            info[k] = {"metrics_start": metrics(alive[k].url)}
            if len(alive) < 2:
                continue
            for r in range(a.rounds):
                order = sorted(alive) if r % 2 == 0 else sorted(alive, reverse=True)
                for j in order:
                    for c in CASES:
                        t = served_tpot(alive[j].url, BATCH, 1, c)
                        raw[c][j].append(t)
                        samples[c].append((j, slot, t))
                slot += 1
                print(f"phase {k - 1} round {r}: " + "; ".join(
                    f"start {j} " + ", ".join(f"{c} {raw[c][j][-1]:.1f}" for c in CASES)
                    for j in sorted(alive)), flush=True)
            old = min(alive)
            info[old].update(metrics_end=metrics(alive[old].url),
                             engine=engine_threads(alive[old].proc.pid))
            if k < a.starts - 1:
                alive.pop(old).stop()
        for j, s in alive.items():
            info[j].update(metrics_end=metrics(s.url), engine=engine_threads(s.proc.pid))
    finally:
        for s in alive.values():
            s.stop()
    result = {c: {"fit": fit(samples[c], a.starts), "raw_spread": spread(raw[c]),
                  "pairs": pair_ratios(samples[c]),
                  "median_ms": [round(statistics.median(v), 2) for v in raw[c].values()]}
              for c in CASES}
    data = {"tpot_ms": raw, "samples": samples, "result": result, "per_start": info,
            "env": env, "note": load_note(run)}
    path = run.finish(data)
    fig, axes = figure(2, width=6)
    for ax, c in zip(axes, CASES):
        for k, v in raw[c].items():
            ax.scatter([k] * len(v), v, s=14, color="#37a")
            ax.plot([k - 0.3, k + 0.3], [statistics.median(v)] * 2, color="#a33")
        f = result[c]["fit"]
        ax.set_xlabel("server start")
        ax.set_ylabel(f"TPOT ms, batch {BATCH}")
        ax.set_title(f"{c}: start effects sd {f['start_effect_sd_pct']}%, residual "
                     f"{f['residual_pct']}%\n{data['note']}", fontsize=9)
    save_figure(fig, name)
    for c in CASES:
        print(f"{c}: {result[c]}")
    print(path)


if __name__ == "__main__":
    main()
