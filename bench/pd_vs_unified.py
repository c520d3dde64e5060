"""PD against unified on equal cores: TTFT and inter-token latency (p50, p99) of 1P1D and of a
unified server on the same mixed workload (long prompts arriving while others decode), and
TTFT at low load (one request at a time), measured side by side in one run.

Equal cores: unified pinned to CPUs 0,1 with 2 torch threads; P pinned to CPU 0 and D to CPU 1,
1 torch thread each (OMP_NUM_THREADS/MKL_NUM_THREADS in each server's environment, which torch
reads at start; pdserve sets no thread count of its own). Every server also gets
OMP_WAIT_POLICY=PASSIVE (--omp-wait-policy) so that a 2-thread team does not spin-wait on a
shared machine. The router and this client are not pinned. The pinning and thread counts each
process really got are read back from /proc.

Lifecycle:
1. spawn unified and 1P1D (--backend, shm by default) at once; wait until both answer;
2. warm up each (a short and a long request);
3. low load: one request at a time, long prompts (--long-len) then short ones (--short-len),
   the systems alternating per request; TTFT of each;
4. mixed workload, per round and system (alternating order): --streams closed-loop clients
   decode short-prompt, long-output requests; after a lead-in, --long-requests long prompts
   arrive every --long-interval seconds (default: --gap-factor x unified's low-load TTFT of a
   long prompt, so prefill keeps the engine busy about 1/gap-factor of the time); the window
   runs from the first long arrival to the last long completion; ITL = gaps between streamed
   chunks of the decoding requests inside the window; TTFT of long and short requests;
   decode tokens/s in the window;
5. RATIOS pd/unified (targets: p99 ITL <= 0.5x, low-load long-prompt TTFT <= 1.15x);
   bench/results/pd_vs_unified.json and .png (ITL and TTFT bars, ITL timeline of the last
   round).

Run: `python bench/pd_vs_unified.py [--quick] [--backend shm|tcp]`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import (
    Run,
    alternating,
    bar_groups,
    figure,
    load_note,
    ratio,
    save_figure,
    summary,
)
from serving import Result, start_systems, stream_completion, vocab_size

NAME = "pd_vs_unified"
TARGETS = {"itl_p99_max_ratio": 0.5, "ttft_low_load_max_ratio": 1.15}


def prompt_of(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(length)]


# -- phases ------------------------------------------------------------------------------------
async def low_load_ttft(urls: dict[str, str], prompts: dict[str, list[list[int]]]
                        ) -> dict[str, dict[str, list[float]]]:
    """{kind: {system: [ttft, ...]}}, one request in flight at a time."""
    out: dict[str, dict[str, list[float]]] = {k: {s: [] for s in urls} for k in prompts}
    async with httpx.AsyncClient() as client:
        for kind, plist in prompts.items():
            for i, p in enumerate(plist):
                for s in alternating(list(urls), i):
                    r = await stream_completion(client, urls[s], p, 2, kind)
                    if r.error or r.ttft is None:
                        raise RuntimeError(f"{s}: low-load {kind} request failed: {r.error}")
                    out[kind][s].append(r.ttft)
                    print(f"low load {kind:5s} {len(p):5d} tok  {s:8s} TTFT {r.ttft:.3f}s",
                          flush=True)
    return out


async def mixed(url: str, args: argparse.Namespace, longs: list[list[int]],
                shorts: list[list[int]], interval: float) -> dict[str, Any]:
    """One round of the mixed workload against one system."""
    results: list[Result] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.streams + len(longs) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def decoder(i: int) -> None:
            n = 0
            while not stop.is_set():
                p = shorts[(i + n * args.streams) % len(shorts)]
                await stream_completion(client, url, p, args.decode_len, "short", sink=results)
                n += 1

        decoders = [asyncio.create_task(decoder(i)) for i in range(args.streams)]
        await asyncio.sleep(args.lead_in)
        t0 = time.perf_counter()
        long_tasks = []
        for j, p in enumerate(longs):
            await asyncio.sleep(max(0.0, t0 + j * interval - time.perf_counter()))
            long_tasks.append(asyncio.create_task(
                stream_completion(client, url, p, args.long_out, "long", sink=results)))
        await asyncio.gather(*long_tasks)
        t1 = time.perf_counter()
        stop.set()
        for d in decoders:
            d.cancel()
        await asyncio.gather(*decoders, return_exceptions=True)
    return window_stats(results, t0, t1)


def window_stats(results: list[Result], t0: float, t1: float) -> dict[str, Any]:
    shorts = [r for r in results if r.kind == "short"]
    longs = [r for r in results if r.kind == "long"]
    gaps, gap_times, tokens = [], [], 0
    for r in shorts:
        t = r.chunk_times
        for a, b in pairwise(t):
            if t0 <= b <= t1:
                gaps.append(b - a)
                gap_times.append(b - t0)
        tokens += sum(1 for x in t if t0 <= x <= t1)
    short_ttft = [r.ttft for r in shorts if r.ttft is not None and t0 <= r.start <= t1]
    errors = [r.error for r in results if r.error and r.error != "cancelled"]
    return {
        "window_s": t1 - t0, "itl_s": summary(gaps),
        "itl_share_over_1s": sum(g > 1.0 for g in gaps) / max(1, len(gaps)),
        "ttft_long_s": summary([r.ttft for r in longs if r.ttft is not None]),
        "ttft_short_s": summary(short_ttft),
        "decode_tok_s": tokens / max(1e-9, t1 - t0),
        "long_e2e_s": summary([r.end - r.start for r in longs if r.end]),
        "errors": len(errors), "error_samples": errors[:3],
        "gaps": gaps, "gap_times": gap_times,
        "long_requests": [asdict(r) for r in longs],
    }


def merged(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles over all rounds' gaps / TTFTs (each round keeps its own numbers too)."""
    gaps = [g for r in rounds for g in r["gaps"]]
    lt = [x["ttft"] for r in rounds for x in r["long_requests"] if x["ttft"] is not None]
    return {"itl_s": summary(gaps), "ttft_long_s": summary(lt),
            "itl_share_over_1s": sum(g > 1.0 for g in gaps) / max(1, len(gaps)),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rounds),
            "errors": sum(r["errors"] for r in rounds)}


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--backend", default="shm", help="PD transfer backend")
    ap.add_argument("--long-len", type=int, nargs=2, default=[1500, 2000], metavar=("MIN", "MAX"))
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=256, help="output of decoding requests")
    ap.add_argument("--long-out", type=int, default=8, help="output of long-prompt requests")
    ap.add_argument("--streams", type=int, default=4, help="concurrent decoding requests")
    ap.add_argument("--long-requests", type=int, default=6, help="per round and system")
    ap.add_argument("--long-interval", type=float, default=0.0, help="s; 0: calibrated")
    ap.add_argument("--gap-factor", type=float, default=2.5)
    ap.add_argument("--lead-in", type=float, default=3.0, help="s of decoding before longs")
    ap.add_argument("--ttft-reps", type=int, default=3, help="low-load requests per kind")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=12288, help="KV pool per server")
    ap.add_argument("--unified-cpus", default="0,1")
    ap.add_argument("--p-cpus", default="0")
    ap.add_argument("--d-cpus", default="1")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY of every server ('' leaves it unset: OpenMP threads "
                         "spin, which on a shared machine stalls 2-thread servers badly)")
    ap.add_argument("--pd-threads", type=int, default=0,
                    help="torch threads of P and of D; 0: one per core of --p-cpus/--d-cpus. "
                         "Shared cores: --p-cpus 0,1 --d-cpus 0,1 --pd-threads 2")
    ap.add_argument("--server-flag", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.long_len, args.decode_len, args.streams, args.long_requests = [400, 500], 48, 2, 2
        args.ttft_reps, args.rounds, args.lead_in, args.max_total_tokens = 1, 1, 1.0, 4096
    # what serving.spawn_system reads
    args.pin, args.unified_threads, args.url = True, 0, None
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    run = Run(args.name, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    kinds = {"unified": "unified", "pd": f"pd-{args.backend}"}
    started = start_systems(list(kinds.values()), args)
    systems = {name: started[k] for name, k in kinds.items()}
    try:
        data = asyncio.run(measure({n: s.url for n, s in systems.items()}, args))
        data["affinity"] = {n: s.affinity() for n, s in systems.items()}
    finally:
        for s in systems.values():
            s.stop()
    path = run.finish(data, args.out_dir)
    report(data, load_note(run), path)
    plot(data, args, load_note(run))
    return data


async def measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = vocab_size(urls["unified"])
    lo, hi = args.long_len
    n_long = args.long_requests * args.rounds
    longs = [prompt_of(rng, rng.randint(lo, hi), vocab) for _ in range(n_long)]
    shorts = [prompt_of(rng, args.short_len, vocab) for _ in range(4 * args.streams)]
    async with httpx.AsyncClient() as client:  # warm-up: kernels for both shapes
        for url in urls.values():
            for p in (shorts[0], longs[0][:lo]):
                await stream_completion(client, url, p, 4)
    low = await low_load_ttft(urls, {
        "long": [prompt_of(rng, rng.randint(lo, hi), vocab) for _ in range(args.ttft_reps)],
        "short": [prompt_of(rng, args.short_len, vocab) for _ in range(args.ttft_reps)]})
    interval = args.long_interval or min(60.0, max(1.0, args.gap_factor * statistics.median(
        low["long"]["unified"])))
    print(f"long prompts every {interval:.1f}s", flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in urls}
    for rnd in range(args.rounds):
        chunk = longs[rnd * args.long_requests:(rnd + 1) * args.long_requests]
        for s in alternating(list(urls), rnd):
            st = await mixed(urls[s], args, chunk, shorts, interval)
            rounds[s].append(st)
            print(f"round {rnd} {s:8s} ITL p50 {st['itl_s'].get('p50', 0) * 1000:6.0f}ms p99 "
                  f"{st['itl_s'].get('p99', 0) * 1000:6.0f}ms max {st['itl_s'].get('max', 0):.2f}s"
                  f"  long TTFT p50 {st['ttft_long_s'].get('p50', 0):.2f}s  decode "
                  f"{st['decode_tok_s']:.1f} tok/s  errors {st['errors']}", flush=True)
    mix = {s: merged(r) for s, r in rounds.items()}
    low_stats = {k: {s: summary(v) for s, v in d.items()} for k, d in low.items()}
    u, p = mix["unified"], mix["pd"]
    ratios = {
        "itl_p50": ratio(p["itl_s"].get("p50", 0), u["itl_s"].get("p50", 0)),
        "itl_p99": ratio(p["itl_s"].get("p99", 0), u["itl_s"].get("p99", 0)),
        "ttft_low_load_long_p50": ratio(statistics.median(low["long"]["pd"]),
                                        statistics.median(low["long"]["unified"])),
        "ttft_low_load_short_p50": ratio(statistics.median(low["short"]["pd"]),
                                         statistics.median(low["short"]["unified"])),
        "ttft_mixed_long_p50": ratio(p["ttft_long_s"].get("p50", 0),
                                     u["ttft_long_s"].get("p50", 0)),
        "decode_tok_s_mixed": ratio(p["decode_tok_s"], u["decode_tok_s"]),
    }
    met = {"itl_p99": ratios["itl_p99"] <= TARGETS["itl_p99_max_ratio"],
           "ttft_low_load": ratios["ttft_low_load_long_p50"] <= TARGETS["ttft_low_load_max_ratio"]}
    return {"long_interval_s": interval, "low_load_ttft_s": low, "low_load_ttft": low_stats,
            "mixed": mix, "mixed_rounds": rounds, "ratios_pd_over_unified": ratios,
            "targets": TARGETS, "targets_met": met}


def report(data: dict[str, Any], note: str, path: Path) -> None:
    mix, low = data["mixed"], data["low_load_ttft"]
    print(f"\n{'':8s} {'ITL p50':>8} {'p99':>7} {'max':>6} {'>1s':>5} {'long TTFT':>10} "
          f"{'decode tok/s':>12} | low-load TTFT long / short")
    for s, m in mix.items():
        i = m["itl_s"]
        print(f"{s:8s} {i.get('p50', 0) * 1000:6.0f}ms {i.get('p99', 0) * 1000:5.0f}ms "
              f"{i.get('max', 0):5.2f}s {m['itl_share_over_1s']:5.1%} "
              f"{m['ttft_long_s'].get('p50', 0):9.2f}s {m['decode_tok_s']:12.1f} | "
              f"{low['long'][s]['p50']:.3f}s / {low['short'][s]['p50']:.3f}s")
    r, t, met = data["ratios_pd_over_unified"], data["targets"], data["targets_met"]
    print(f"RATIO pd/unified: ITL p99 {r['itl_p99']:.2f}x (target <= {t['itl_p99_max_ratio']}: "
          f"{'met' if met['itl_p99'] else 'NOT met'}), ITL p50 {r['itl_p50']:.2f}x, TTFT low load "
          f"long {r['ttft_low_load_long_p50']:.2f}x (target <= {t['ttft_low_load_max_ratio']}: "
          f"{'met' if met['ttft_low_load'] else 'NOT met'}), short "
          f"{r['ttft_low_load_short_p50']:.2f}x, long TTFT mixed {r['ttft_mixed_long_p50']:.2f}x,"
          f" decode tok/s mixed {r['decode_tok_s_mixed']:.2f}x")
    print(f"({note}) -> {path}")


def plot(data: dict[str, Any], args: argparse.Namespace, note: str) -> None:
    mix, low = data["mixed"], data["low_load_ttft"]
    systems = list(mix)
    fig, (a, b, c) = figure(3, 4.8, 4.0)
    bar_groups(a, ["ITL p50", "ITL p99"], {s: [mix[s]["itl_s"].get("p50", 0) * 1000,
                                               mix[s]["itl_s"].get("p99", 0) * 1000]
                                           for s in systems},
               "ms", "mixed workload ITL (p99 ratio "
               f"{data['ratios_pd_over_unified']['itl_p99']:.2f}x)")
    a.set_yscale("log")
    bar_groups(b, ["low load\nlong", "low load\nshort", "mixed\nlong"],
               {s: [low["long"][s]["p50"], low["short"][s]["p50"],
                    mix[s]["ttft_long_s"].get("p50", 0)] for s in systems},
               "s", "TTFT p50")
    for s in systems:
        last = data["mixed_rounds"][s][-1]
        c.scatter(last["gap_times"], [g * 1000 for g in last["gaps"]], s=4, label=s, alpha=0.6)
    c.set_yscale("log")
    c.set_xlabel("s since first long prompt (last round)")
    c.set_ylabel("inter-token gap (ms)")
    c.set_title("decode gaps over time")
    c.legend(fontsize=8)
    fig.suptitle(f"1P1D ({args.backend}; P cpu {args.p_cpus}, D cpu {args.d_cpus}) vs unified "
                 f"(cpus {args.unified_cpus}); long prompts {args.long_len[0]}-{args.long_len[1]}"
                 f" tok; {note}", fontsize=9)
    save_figure(fig, args.name, args.out_dir)


if __name__ == "__main__":
    main()
