"""A noisy neighbour (#47 item 5): one busy process pinned on one core while a unified pdserve
serves 128 in / 64 out at concurrency 8. Does pdserve lose in proportion to the CPU the
neighbour takes, or collapse (an OpenMP team whose threads spin at each barrier waiting for a
peer the kernel descheduled)?

Per variant (one server each: pdserve's defaults, whose thread team adapts to the neighbour
at run time, `no adapt` (PDSERVE_CPU_TEAM_ADAPT=0), and thread / wait-policy variants given
as environment or flags), rounds alternate "alone" and "neighbour" (`python -c 'while 1:
pass'` pinned to --neighbour-cpu, in a session of its own at the bench's session weight, the
way the server is: with the kernel's autogroups, nice is per session). Per round: output tok/s,
TPOT, the server's and the neighbour's CPU seconds; the ratio neighbour / alone is set against
the proportional expectation: the CPU share left to the server ((cpus - neighbour's share of
its core) / cpus, about 0.75 when the neighbour gets half of one of 2 cores).

Run (a timing run: quiet lock, own session): `python bench/noisy_neighbour.py [--quick]`;
writes bench/results/noisy_neighbour.json / .png (CPU flags, load, nice and autogroup in
`machine`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, cpu_seconds, figure, load_note, save_figure, start_unified, tree_affinity
from serving import closed_loop, latency_stats, random_prompts, vocab_size

from pdcore.runtime.lifeline import popen_session

NAME = "noisy_neighbour"
# name -> (server flags, server environment)
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": ((), {}),  # the team adapts at run time (pdcore/runtime/cpu_team.py)
    "no adapt": ((), {"PDSERVE_CPU_TEAM_ADAPT": "0"}),  # the team as placed
    "passive": ((), {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}),
    "spin 2M": ((), {"GOMP_SPINCOUNT": "2000000"}),
    "1 thread": (("--cpu-omp-threads-bind", "0"), {}),
    "nobind": (("--cpu-omp-threads-bind", "nobind"), {}),  # unpinned, passive wait
}


def neighbour(cpu: int) -> Any:
    """The busy loop, pinned to `cpu`, in a session of its own with this session's weight."""
    return popen_session(["taskset", "-c", str(cpu), sys.executable, "-c", "while 1: pass"])


def team(url: str) -> dict[str, float]:
    """The server's pdserve_scheduler_cpu_team_* values (threads now, changes, probes)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return {k: float(v) for k, v in re.findall(r"^pdserve_scheduler_(cpu_team_\w+) (\S+)$", text,
                                               re.MULTILINE)}


def one_round(url: str, prompts: list[list[int]], args: argparse.Namespace, pid: int,
              busy: int | None) -> dict[str, Any]:
    hog = neighbour(busy) if busy is not None else None
    team0 = team(url)
    try:
        time.sleep(0.5 if hog else 0)  # it is running before the first request
        hog_cpu0 = cpu_seconds(hog.pid) if hog else 0.0
        cpu0 = cpu_seconds(pid)
        results, wall = asyncio.run(closed_loop(url, prompts, args.output, args.concurrency))
        cpu = cpu_seconds(pid) - cpu0
        hog_cpu = (cpu_seconds(hog.pid) - hog_cpu0) if hog else 0.0
    finally:
        if hog:
            hog.kill()
            hog.wait(10)
    st = latency_stats(results)
    team1 = team(url)
    return {"neighbour": busy is not None, "wall_s": wall, "team_before": team0,
            "team_after": team1,
            "tok_s": st["output_tokens"] / wall, "errors": st["errors"],
            "tpot_ms_p50": st["tpot_s"]["p50"] * 1e3 if st["tpot_s"] else None,
            "ttft_s_p50": st["ttft_s"]["p50"] if st["ttft_s"] else None,
            "server_cpu_s": cpu, "server_cores": cpu / wall,
            "neighbour_cores": hog_cpu / wall, "loadavg": list(os.getloadavg())}


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    flags, env = VARIANTS[name]
    server = start_unified(args.model_path, ("--max-total-tokens", "8192", *flags), env=env)
    try:
        url, pid = server.url, server.proc.pid
        vocab = vocab_size(url)
        prompts = random_prompts(args.requests, args.input, vocab, seed=0)
        asyncio.run(closed_loop(url, prompts[:args.concurrency], 4, args.concurrency))  # warm
        placement = [line for line in server.log().splitlines() if "OpenMP" in line][-1:]
        rounds = []
        for rnd in range(args.rounds):
            for busy in ((None, args.neighbour_cpu) if rnd % 2 == 0
                         else (args.neighbour_cpu, None)):
                r = one_round(url, prompts, args, pid, busy)
                rounds.append(r)
                print(f"{name} round {rnd} {'neighbour' if busy is not None else 'alone'}: "
                      f"{r['tok_s']:.1f} tok/s, TPOT {r['tpot_ms_p50']:.0f} ms, server "
                      f"{r['server_cores']:.2f} cores, neighbour {r['neighbour_cores']:.2f}, "
                      f"team {r['team_after'].get('cpu_team_threads')} threads, "
                      f"{r['team_after'].get('cpu_team_changes_total')} changes "
                      f"(load {r['loadavg'][0]:.1f})", flush=True)
        affinity = tree_affinity(pid)
        team_log = [line for line in server.log().splitlines() if "CPU team" in line]
    finally:
        server.stop()
    alone = statistics.median(r["tok_s"] for r in rounds if not r["neighbour"])
    with_n = statistics.median(r["tok_s"] for r in rounds if r["neighbour"])
    taken = statistics.median(r["neighbour_cores"] for r in rounds if r["neighbour"])
    cpus = len(os.sched_getaffinity(0))
    return {"flags": flags, "env": env, "placement_log": placement, "team_log": team_log,
            "affinity": affinity,
            "rounds": rounds, "tok_s_alone": alone, "tok_s_neighbour": with_n,
            "ratio": with_n / alone, "neighbour_cores": taken,
            "proportional_ratio": (cpus - min(taken, 1.0)) / cpus}


def plot(data: dict[str, Any], note: str) -> Path:
    fig, (ax,) = figure(1, width=7)
    names = list(data["variants"])
    for off, key, label, color in ((-0.2, "tok_s_alone", "alone", "#888"),
                                   (0.2, "tok_s_neighbour", "busy neighbour on 1 core", "#c53")):
        ax.bar([i + off for i in range(len(names))],
               [data["variants"][n][key] for n in names], 0.4, label=label, color=color)
    for i, n in enumerate(names):
        v = data["variants"][n]
        ax.text(i, max(v["tok_s_alone"], v["tok_s_neighbour"]),
                f"{v['ratio']:.2f}x\n(prop. {v['proportional_ratio']:.2f})", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("output tok/s (median of rounds)")
    ax.set_title(f"unified, 128/64 c8 ({note})", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, NAME)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--input", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16, help="per round")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of alone / neighbour")
    ap.add_argument("--neighbour-cpu", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="8 requests, 1 round pair")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.rounds = a.concurrency, 1
    run = Run(NAME, vars(a))
    variants = {}
    for name in a.variants:
        variants[name] = run_variant(name, a)
    data = {"variants": variants, "note": load_note(run)}
    path = run.finish(data)
    plot(data, load_note(run))
    for n, v in variants.items():
        print(f"{n}: alone {v['tok_s_alone']:.1f}, neighbour {v['tok_s_neighbour']:.1f} tok/s "
              f"= {v['ratio']:.2f}x (proportional {v['proportional_ratio']:.2f}x)")
    print(path)


if __name__ == "__main__":
    main()
