"""Paged decode attention at long contexts: milliseconds a layer and the GB/s of K and V it
reads, for SmolLM2-135M's heads (3 KV heads x 3 query heads of 64) at 1 x 4k and 4 x 4k
tokens of context and a Llama-3.2-1B's (8 x 4 of 64) at 1 x 16k: the cases of #47's
4096/256 c4 and 16384/128 c1 runs.

Each call reads another layer's pool (a ring of pools of 512 MB or more in all, `--ring-mb`), as a decode
step does, so K and V come from memory, not from the last-level cache. Wall clock at
`--threads` torch threads (the engine's team: 2 on the 2-core box), median of `--reps`
rounds over the ring.

`--baseline PYTHONPATH` measures the same cases a second time in a child process whose pdcore
is that checkout (e.g. main before a kernel change), alternating with this one round by
round, and reports both and the speedup. Writes bench/results/decode_attention_rows.json and
.png.

Run: `python bench/decode_attention_rows.py [--baseline /path/to/main] [--threads 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure

NAME = "decode_attention_rows"
# name: (kv heads, query heads per KV head, head_dim, batch, context)
CASES = {
    "smollm2 1x4096": (3, 3, 64, 1, 4096),
    "smollm2 4x4096": (3, 3, 64, 4, 4096),
    "1b 1x16384": (8, 4, 64, 1, 16384),
}


def measure(threads: int, reps: int, scattered: bool, ring_mb: int) -> list[dict[str, Any]]:
    import torch

    from pdcore.engine import native

    o = native.ops()
    if o is None:
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    torch.set_num_threads(threads)
    rows = []
    for case, (kvh, grp, d, b, ctx) in CASES.items():
        slots = b * ctx + 64
        nbytes = 2 * b * ctx * kvh * d * 4  # K and V read a call
        ring = max(1, -(-ring_mb * 2**20 // (2 * slots * kvh * d * 4)))
        g = torch.Generator().manual_seed(0)
        pools = [(torch.randn(slots, kvh, d, generator=g), torch.randn(slots, kvh, d, generator=g))
                 for _ in range(ring)]
        table = (torch.randperm(slots, generator=g)[: b * ctx] if scattered
                 else torch.arange(b * ctx))
        q = torch.randn(b, kvh, grp, d, generator=g)
        for kp, vp in pools:  # warm-up, one round
            o.decode_attention_paged(q, kp, vp, table, None, d**-0.5)
        per_call = []
        for _ in range(reps):
            t = time.perf_counter()
            for kp, vp in pools:
                o.decode_attention_paged(q, kp, vp, table, None, d**-0.5)
            per_call.append((time.perf_counter() - t) / ring)
        ms = statistics.median(per_call) * 1e3
        # the ceiling: the same bytes summed by torch (a plain stream over the same pools)
        stream = []
        for _ in range(reps):
            t = time.perf_counter()
            for kp, vp in pools:
                kp[: b * ctx].sum(), vp[: b * ctx].sum()
            stream.append((time.perf_counter() - t) / ring)
        rows.append({"case": case, "ring": ring, "ms": ms, "min_ms": min(per_call) * 1e3,
                     "GBps": nbytes / (ms * 1e-3) / 1e9,
                     "stream_GBps": nbytes / statistics.median(stream) / 1e9})
        del pools
    return rows


def plot(data: dict[str, Any], name: str) -> Path:
    fig, axes = figure(1, width=7)
    ax = axes[0]
    cases = list(CASES)
    systems = [s for s in ("baseline", "this") if s in data]
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        gbps = [next(r["GBps"] for r in data[s] if r["case"] == c) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], gbps, width, label=s)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(cases))], cases)
    ax.set_ylabel("K+V read, GB/s")
    ax.set_title(f"paged decode attention, {data['threads']} threads")
    ax.legend()
    return save_figure(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="rounds over the ring (median)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --baseline")
    ap.add_argument("--scattered", action="store_true",
                    help="slots in random order (a fragmented pool) instead of one run")
    ap.add_argument("--baseline", help="PYTHONPATH of the pdcore to compare against")
    ap.add_argument("--ring-mb", type=int, default=512,
                    help="MB of pools a round goes through (1: one pool, in cache where it fits)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", default=NAME)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads, args.reps, args.scattered, args.ring_mb)))
        return
    run = Run(args.name, vars(args))
    data: dict[str, Any] = {"threads": args.threads, "this": [], "baseline": []}
    for _ in range(args.rounds if args.baseline else 1):
        data["this"].append(measure(args.threads, args.reps, args.scattered, args.ring_mb))
        if args.baseline:
            cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads),
                   "--reps", str(args.reps), "--ring-mb", str(args.ring_mb)] + (["--scattered"] if args.scattered else [])
            env = {**os.environ, "PYTHONPATH": args.baseline}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                                 timeout=1800).stdout
            data["baseline"].append(json.loads(out.strip().splitlines()[-1]))
    for key in ("this", "baseline"):  # the best round of each case (least disturbed)
        rounds = data.pop(key)
        if rounds:
            data[key] = [min((r[i] for r in rounds), key=lambda r: r["ms"])
                         for i in range(len(CASES))]
            data[f"{key}_rounds"] = rounds
    for i, case in enumerate(CASES):
        line = (f"{case}: {data['this'][i]['ms']:.2f} ms, {data['this'][i]['GBps']:.1f} GB/s"
                f" (a torch sum of the same bytes: {data['this'][i]['stream_GBps']:.1f} GB/s)")
        if "baseline" in data:
            b = data["baseline"][i]
            data["this"][i]["speedup"] = b["ms"] / data["this"][i]["ms"]
            line += (f" (baseline {b['ms']:.2f} ms, {b['GBps']:.1f} GB/s:"
                     f" {data['this'][i]['speedup']:.2f}x)")
        print(line, flush=True)
    data["load"] = load_note(run)
    path = run.finish(data)
    print(f"{data['load']}; wrote {path} and {plot(data, args.name)}")


if __name__ == "__main__":
    main()
