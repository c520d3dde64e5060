"""The attention softmax and block join (#47, s14): two builds of the native library side by
side, alternating, each in a child process of its own (one library a process): `--trees
base=DIR,new=DIR`, each DIR a source tree (its pdcore is imported, its library built or loaded
from the cache keyed by its sources). Each child times:
- `kernel`: prefill_attention_paged, one layer's causal attention of an n-token prompt over a
  paged pool at scattered slots: bf16 (queries and pool: the vdpbf16ps order where the CPU has
  it) and float32, at SmolLM2-135M's heads (3 KV x 3 of 64) and the 1B shape's (8 KV x 4 of 64);
  GFLOP/s counts the causal half;
- `engine`: a whole SmolLM2 bf16 prefill of --engine-n fresh tokens (LLMEngine, 1 new token).
Best of the rounds per row (each a median of --reps after a warm-up). `--clock process`: the
kernel's CPU seconds (time.process_time; with --threads 1, the kernel's own work, less moved by
a loaded box than wall time) instead of wall seconds. Writes
bench/results/softmax_join<suffix>.json (load and CPU recorded). Timing run: under the quiet lock
(`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/softmax_join.py --suffix _s14`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHAPES = {"smol": (3, 3, 64), "1b": (8, 4, 64)}


def child(args: argparse.Namespace) -> None:
    import random
    import time

    import torch

    sys.path.insert(0, str(HERE))
    from common import timed

    if args.clock == "process":
        def timed(fn, reps):  # noqa: F811 - the kernel's CPU seconds, best of reps
            fn()
            xs = []
            for _ in range(reps):
                t0 = time.process_time()
                fn()
                xs.append(time.process_time() - t0)
            return min(xs)

    from pdcore.engine import native

    native.BUILD_TIMEOUT_S = 1500  # this process only
    o = native.ops()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for spec in filter(None, args.kernel.split(",")):
        shape, dt, n = spec.split(":")
        kvh, grp, d = SHAPES[shape]
        n = int(n)
        page, pages = 16, int(n) // 16 + 4
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        kp = torch.randn(pages, page, kvh, d, generator=g).to(dtype)
        vp = torch.randn(pages, page, kvh, d, generator=g).to(dtype)
        slots = torch.randperm(pages * page, generator=g)[:n]
        q = torch.randn(n, kvh * grp, d, generator=g).to(dtype)
        reps = args.reps if n <= 4096 else max(1, args.reps // 2)
        t = timed(lambda: o.prefill_attention_paged(q, kp, vp, slots, d**-0.5, 1.0, 1.0, kvh), reps)
        out[spec] = t
    if args.engine_n:
        from pdcore.config import ServerArgs
        from pdcore.messages.io import SamplingParams
        from pdcore.runtime.llm_engine import LLMEngine

        eng = LLMEngine(ServerArgs(model_path=None, dtype="bfloat16",
                                   max_total_tokens=args.engine_n + 2048, log_level="warning"))
        sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        rng = random.Random(0)
        eng.generate([[rng.randrange(100, 40000) for _ in range(64)]], sp)
        xs = []
        for _ in range(args.engine_reps):
            ps = [[rng.randrange(100, 40000) for _ in range(args.engine_n)]]
            t0 = time.perf_counter()
            eng.generate(ps, sp)
            xs.append(time.perf_counter() - t0)
        out[f"engine:smol-bf16:{args.engine_n}"] = min(xs)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default="")
    ap.add_argument("--kernel", default="smol:bf16:1024,smol:bf16:4096,1b:bf16:1024,"
                    "1b:bf16:4096,1b:bf16:16384,smol:f32:4096,1b:f32:1024,1b:f32:4096,"
                    "1b:f32:16384")
    ap.add_argument("--engine-n", type=int, default=4096)
    ap.add_argument("--engine-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "process"), default="wall")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(HERE))
    from common import Run

    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    run = Run(f"softmax_join{args.suffix}", vars(args))
    per: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    fwd = [f"--kernel={args.kernel}", f"--engine-n={args.engine_n}", f"--reps={args.reps}",
           f"--engine-reps={args.engine_reps}", f"--threads={args.threads}",
           f"--clock={args.clock}"]
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        for name in order:
            env = dict(os.environ, PYTHONPATH=trees[name])
            p = subprocess.run([sys.executable, __file__, "--child", *fwd], env=env, cwd="/work",
                               capture_output=True, text=True, timeout=1800)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                sys.exit(f"{name}: child failed ({p.returncode}): {p.stderr[-2000:]}")
            per[name].append(json.loads(line[0][7:]))
            print(f"round {rnd} {name}: {per[name][-1]}", flush=True)
    rows: list[dict[str, Any]] = []
    names = list(trees)
    for key in per[names[0]][0]:
        row: dict[str, Any] = {"case": key}
        for name in names:
            row[f"{name}_s"] = min(r[key] for r in per[name])
        if key.startswith(("smol", "1b")):
            shape, _, n = key.split(":")
            kvh, grp, d = SHAPES[shape]
            flops = 4 * kvh * grp * d * int(n) * (int(n) + 1) / 2
            for name in names:
                row[f"{name}_gflops"] = flops / row[f"{name}_s"] / 1e9
        row["speedup"] = row[f"{names[0]}_s"] / row[f"{names[-1]}_s"]
        rows.append(row)
        print(f"{key:24s} " + " ".join(f"{n} {row[f'{n}_s'] * 1e3:9.1f} ms" for n in names)
              + f"  x{row['speedup']:.3f}", flush=True)
    print(run.finish({"rows": rows, "per_round": per}))
    from common import figure, save_figure

    fig, (ax,) = figure(1, width=9)
    xs = range(len(rows))
    ax.bar(list(xs), [r["speedup"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), [r["case"] for r in rows], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(f"{names[0]} / {names[-1]} ({args.clock} time)")
    ax.set_title(f"softmax + join, {names[-1]} vs {names[0]} ({run.machine_start['cpu'][:30]})")
    print(save_figure(fig, f"softmax_join{args.suffix}"))


if __name__ == "__main__":
    main()
