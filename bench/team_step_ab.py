"""A float32 decode step's layer loop beside a busy neighbour (#47): the separate operators
(the native plan's int8_fused = 1: a fork and a join of the thread team per operator) against
the one-region step with its work handed out by phase (3: native team_f32.h).

Lifecycle:
1. load pdserve's engine in float32 (--model-path, default /work/smollm2-hf: SmolLM2's HF
   folder; the packaged GGUF is served as GGUF blocks, which the team does not take), every
   GEMM weight in panels (PDCORE_GEMM_LAYOUT=panels unless set: `auto` may give a shape
   oneDNN's layout, where the team does not apply);
2. per co-runner duty (--co-runners: 0 none; 0.5: a process of ours busy half of every 4 ms on
   one core, what a server's HTTP process and its clients do to a 2-core box) and per shape
   (--shapes, B x ctx), one generate of B random prompts of ctx tokens (the served path:
   the decode view filled, then appended to), its decode steps' native layer loop
   (fast_layers) timed by wall clock, the mode flipped every --iters steps: --rounds rounds
   of both modes, the order alternating by round; medians per round;
3. the ratio after / before per round, and co-runner / alone per mode;
4. write bench/results/team_step_ab<suffix>.json and .png (load and CPU recorded).

Run: `python bench/team_step_ab.py [--shapes 1x512 6x512 16x1024] [--rounds 6]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bf16_step_profile import co_runner
from common import Run, figure, load_note, save_figure
from engine_throughput import PdserveRunner

NAME = "team_step_ab"
MODES = {"operators": 1, "team": 3}


def time_shape(runner: PdserveRunner, batch: int, ctx: int, rounds: int, iters: int
               ) -> list[dict[str, Any]]:
    """One generate of `batch` prompts of `ctx` tokens (the server's path: the decode view
    filled, then appended to); its decode steps' layer loops timed, the mode flipped every
    `iters` steps (a round: both modes, the order alternating), after `iters` warm-up steps."""
    from pdcore.engine import native
    from pdcore.messages.io import SamplingParams

    model = runner.engine.engine.model
    fn = model.fast_layers
    order = list(MODES)
    rec: list[dict[str, Any]] = [{m: {"ms": [], "team": 0} for m in MODES} for _ in range(rounds)]
    n = [0]

    def wrapped(*a: Any, **k: Any) -> Any:
        i = n[0] - iters  # the first iters steps: warm-up, the operators
        block = i // iters if i >= 0 else -1
        r = block // 2
        mode = "operators" if block < 0 or r >= rounds else (
            order[block % 2] if r % 2 == 0 else order[1 - block % 2])
        model.native["int8_fused"] = MODES[mode]
        team0 = native.op("team_steps")()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        dt = (time.perf_counter() - t0) * 1000
        if out is not None:
            n[0] += 1
            if 0 <= r < rounds:
                rec[r][mode]["ms"].append(dt)
                rec[r][mode]["team"] += native.op("team_steps")() - team0
        return out
    model.fast_layers = wrapped
    try:
        g = torch.Generator().manual_seed(batch * 7919 + ctx)
        prompts = torch.randint(100, runner.vocab - 100, (batch, ctx), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=(2 * rounds + 1) * iters + 2, temperature=0.0,
                            ignore_eos=True)
        runner.engine.generate(prompts, sp)
    finally:
        del model.fast_layers
        model.native["int8_fused"] = 2
    return [{m: {"layers_ms": statistics.median(x[m]["ms"]), "steps": len(x[m]["ms"]),
                 "team_steps": x[m]["team"]} for m in MODES} for x in rec]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("PDCORE_GEMM_LAYOUT", "panels")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="/work/smollm2-hf")
    ap.add_argument("--shapes", nargs="+", default=["1x512", "6x512", "16x1024"])
    ap.add_argument("--co-runners", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--suffix", default="_s14")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if not all(0.0 <= d < 1.0 for d in args.co_runners):
        ap.error(f"--co-runners {args.co_runners}: duties in [0, 1)")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    torch.set_num_threads(args.threads)
    run = Run(NAME + args.suffix, {k: str(v) if isinstance(v, Path) else v
                                   for k, v in vars(args).items()})
    tokens = max(b * (c + (2 * args.rounds + 1) * args.iters + 8) for b, c in shapes)
    runner = PdserveRunner(args.model_path, tokens, "float32")
    results = []
    try:
        model = runner.engine.engine.model
        if model.native is None:
            sys.exit("no native decode loop for this model")
        for duty in args.co_runners:
            with co_runner(duty):
                for b, c in shapes:
                    rounds = time_shape(runner, b, c, args.rounds, args.iters)
                    results.append({"co_runner": duty, "batch": b, "ctx": c, "rounds": rounds})
    finally:
        runner.close()
    summary = []
    for res in results:
        row = {"co_runner": res["co_runner"], "batch": res["batch"], "ctx": res["ctx"]}
        for m in MODES:
            row[m + "_layers_ms"] = statistics.median(x[m]["layers_ms"] for x in res["rounds"])
            row[m + "_team_steps"] = sum(x[m]["team_steps"] for x in res["rounds"])
        ratios = [x["team"]["layers_ms"] / x["operators"]["layers_ms"] for x in res["rounds"]]
        row["team_over_operators"] = statistics.median(ratios)
        row["team_over_operators_range"] = [min(ratios), max(ratios)]
        summary.append(row)
    for row in summary:  # co-runner / alone per mode, same shape
        alone = next((s for s in summary if s["co_runner"] == 0 and s["batch"] == row["batch"]
                      and s["ctx"] == row["ctx"]), None)
        if alone is not None:
            for m in MODES:
                row[m + "_over_alone"] = row[m + "_layers_ms"] / alone[m + "_layers_ms"]
    path = run.finish({"summary": summary, "results": results}, args.out_dir)
    plot(summary, load_note(run), NAME + args.suffix, args.out_dir)
    for s in summary:
        print(f"co-runner {s['co_runner']} b{s['batch']} x {s['ctx']}: layers operators "
              f"{s['operators_layers_ms']:.2f} ms, team {s['team_layers_ms']:.2f} ms "
              f"(team/operators {s['team_over_operators']:.3f}, rounds "
              f"{s['team_over_operators_range'][0]:.3f}-{s['team_over_operators_range'][1]:.3f}"
              f"; team steps {s['operators_team_steps']}/{s['team_team_steps']})"
              + (f"; over alone: operators {s['operators_over_alone']:.2f}x, team "
                 f"{s['team_over_alone']:.2f}x" if "team_over_alone" in s else ""))
    print(f"({load_note(run)}) -> {path}")
    return {"summary": summary}


def plot(summary: list[dict[str, Any]], note: str, name: str, out_dir: Path | None) -> None:
    """Layer-loop ms per shape and co-runner duty, operators against the team."""
    fig, (a,) = figure(1, 7.0, 4.2)
    labels = [f"b{s['batch']}x{s['ctx']}\nco {s['co_runner']}" for s in summary]
    xs = range(len(summary))
    a.bar([x - 0.2 for x in xs], [s["operators_layers_ms"] for s in summary], 0.4,
          label="operators (int8_fused 1)")
    a.bar([x + 0.2 for x in xs], [s["team_layers_ms"] for s in summary], 0.4,
          label="team, phases (3)")
    a.set_xticks(list(xs), labels, fontsize=7)
    a.set_ylabel("ms per decode step's layer loop (median of rounds)")
    a.legend(fontsize=7)
    fig.suptitle(f"{name}: {note}", fontsize=9)
    save_figure(fig, name, out_dir)


if __name__ == "__main__":
    main()
