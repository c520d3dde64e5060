"""The c4 wave, in process: what `vllm bench serve --concurrency C` does to the scheduler,
without HTTP, and where the wall time goes, step by step.

A closed loop over LLMEngine's engine (no HTTP, no tokenizer): C requests of --input-len random
tokens start at once; each time one finishes (--output-len tokens, ignore_eos) the next starts,
until --num-prompts have run. Every forward is recorded (prefill tokens, decode rows, ms), so
the run's wall time splits into extend and decode steps; the same run is repeated per
--chunked-prefill-size value (--chunk) on one engine, and the summary gives tok/s, TTFT and
TPOT per setting (--timeline keeps every step: [start s, prefill tokens, decode rows, ms]).

Run (timing: under the quiet lock):
  python bench/wave_c4.py --model-path DIR --chunk 2048,512,128,32 --timeline
Writes bench/results/wave_<tag>.json. Findings (s6, SmolLM2 f32, 2 threads): an extend step
costs ~20 ms + 1.36 ms per prompt token at every chunk size, a decode step of 1-4 rows ~24 ms
(the memory floor), so chunk sizes 128..2048 give the same tok/s at 512/128 c4.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, Run, figure, save_figure  # noqa: E402


def plot(data: dict, out_dir: Path) -> Path:
    """tok/s per chunk size, and every extend step's ms against its prompt tokens (by the decode
    rows riding along) with the decode steps' ms."""
    fig, (ax1, ax2) = figure(2)
    runs = [r for r in data["runs"] if r["sampling"] == "greedy"] or data["runs"]
    ax1.bar([str(r["chunk"]) for r in runs], [r["tok_s"] for r in runs])
    ax1.set_xlabel("--chunked-prefill-size")
    ax1.set_ylabel("output tok/s")
    ax1.set_title(f"{data['name']}: closed loop c{data['config']['concurrency']}")
    marks = {}
    for steps in data["timelines"].values():
        for _, pre, dec, ms in steps:
            marks.setdefault(dec if pre else -1, []).append((pre, ms))
    for rows, pts in sorted(marks.items()):
        label = "decode steps (x=0)" if rows < 0 else f"extend, {rows} decode rows"
        ax2.scatter([p for p, _ in pts], [m for _, m in pts], s=8, label=label)
    ax2.set_xscale("symlog", linthresh=16)
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens in the step")
    ax2.set_ylabel("step ms")
    ax2.legend(fontsize=7)
    return save_figure(fig, data["name"], out_dir)


def run_wave(eng, chunk, prompts, out_len, conc, sampling):
    """One closed-loop run; returns (summary, steps)."""
    from pdcore.messages.io import GenerateReq, SamplingParams

    loop = eng.loop
    steps: list[tuple[float, int, int, float]] = []
    orig = loop.run

    def timed(items):
        t0 = time.perf_counter()
        res = orig(items)
        pre = sum(n for r, n in items if n > 1)
        dec = sum(1 for r, n in items if n == 1)
        steps.append((t0 - start, pre, dec, (time.perf_counter() - t0) * 1e3))
        return res

    sp = (SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
          if sampling == "greedy" else SamplingParams(max_new_tokens=out_len, ignore_eos=True))
    loop.run = timed
    start = time.perf_counter()
    t_sent, t_first, t_last, ntok = {}, {}, {}, {}
    todo = list(prompts)
    live = 0
    msgs = []
    try:
        while todo or live:
            while todo and live < conc:
                rid = uuid.uuid4().hex
                msgs.append(GenerateReq(rid, todo.pop(0), sp))
                t_sent[rid] = time.perf_counter()
                ntok[rid] = 0
                live += 1
            for m in eng.lockstep.lead(msgs):
                now = time.perf_counter()
                if m.new_token_ids:
                    t_first.setdefault(m.rid, now)
                    ntok[m.rid] += len(m.new_token_ids)
                    t_last[m.rid] = now
                if m.finished:
                    live -= 1
            msgs = []
    finally:
        loop.run = orig
    wall = time.perf_counter() - start
    ttft = [t_first[r] - t_sent[r] for r in t_sent]
    tpot = [(t_last[r] - t_first[r]) / (ntok[r] - 1) for r in t_sent if ntok[r] > 1]
    ext = [s for s in steps if s[1]]
    dec = [s for s in steps if not s[1]]
    return {
        "chunk": chunk, "sampling": sampling,
        "tok_s": sum(ntok.values()) / wall, "wall_s": wall,
        "mean_ttft_s": statistics.mean(ttft), "mean_tpot_ms": statistics.mean(tpot) * 1e3,
        "extend_steps": len(ext), "extend_s": sum(s[3] for s in ext) / 1e3,
        "decode_steps": len(dec), "decode_s": sum(s[3] for s in dec) / 1e3,
        "mean_decode_ms": statistics.mean(s[3] for s in dec) if dec else None,
        "extend_rows": sum(s[2] for s in ext),
    }, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="default: SmolLM2 (float32)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--chunk", default="2048", help="--chunked-prefill-size values")
    ap.add_argument("--sampling", default="greedy", help="greedy,default")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tag", default="c4")
    ap.add_argument("--timeline", action="store_true", help="keep every step in the JSON")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--replot", help="redraw the PNG of this JSON and exit")
    args = ap.parse_args()
    if args.replot:
        print("wrote", plot(json.loads(Path(args.replot).read_text()), Path(args.out_dir)))
        return

    from pdcore.config import ServerArgs
    from pdcore.runtime.llm_engine import LLMEngine

    rng = random.Random(0)
    eng = LLMEngine(ServerArgs(model_path=args.model_path, max_total_tokens=16384,
                               dtype="float32", log_level="warning"))
    vocab = eng.engine.hf_config.vocab_size
    sched = eng.scheduler
    chunks = [int(c) for c in args.chunk.split(",")]
    run = Run(f"wave_{args.tag}", vars(args))
    out: dict = {"runs": [], "timelines": {}}
    print(f"load before: {os.getloadavg()}", flush=True)
    # warm-up: one short wave
    sched.cfg.chunk_size = 2048
    run_wave(eng, 2048, [[rng.randrange(vocab) for _ in range(args.input_len)]
                              for _ in range(args.concurrency)], 8, args.concurrency, "greedy")
    for rnd in range(args.rounds):
        for sampling in args.sampling.split(","):
            for chunk in chunks:
                # a distinct first token each: no prompt finds another's prefix in the cache
                prompts = [[(i * 7919) % vocab] + [rng.randrange(vocab)
                                                   for _ in range(args.input_len - 1)]
                           for i in range(args.num_prompts)]
                sched.cfg.chunk_size = chunk
                if sched.cache is not None:
                    sched.cache.reset()
                s, steps = run_wave(eng, chunk, prompts, args.output_len,
                                    args.concurrency, sampling)
                s["round"] = rnd
                s["loadavg"] = os.getloadavg()
                out["runs"].append(s)
                if args.timeline:
                    out["timelines"][f"{sampling}/{chunk}/{rnd}"] = steps
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                  for k, v in s.items()}), flush=True)
    eng.close()
    path = run.finish(out, Path(args.out_dir))
    drawn = plot(json.loads(path.read_text()), path.parent) if out["timelines"] else ""
    print("wrote", path, drawn)


if __name__ == "__main__":
    main()
