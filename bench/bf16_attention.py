"""bf16 attention (#47, engine/native/bf16_attn.h): the bf16 order (vdpbf16ps pair dots for
q . k and P V) against the widening order (bf16 widened to float32, float32 FMAs), side by side
in one process and one library over the same bf16 pool: bf16 queries take the bf16 order where
the CPU has vdpbf16ps, float32 copies of the same queries the widening one (a float32 model's
path over a bf16 pool, and every bf16 model's before s13).
- prefill: one layer's causal attention of an n-token prompt at SmolLM2-135M's heads (3 KV x 3
  query heads of 64), scattered slots of a paged pool; GFLOP/s counts the causal half;
- decode: the paged decode kernel, batch x context (one step's attention of a layer).
Median of --reps after a warm-up, the orders alternating. Writes
bench/results/bf16_attention<suffix>.json and .png. Timing run: under the quiet lock
(`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/bf16_attention.py --suffix _s13`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, figure, load_note, save_figure, timed

KVH, G, D = 3, 3, 64  # SmolLM2-135M


def _pool(ctx: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    page = 16
    pages = ctx // page + 4
    kp = torch.randn(pages, page, KVH, D, generator=g).bfloat16()
    vp = torch.randn(pages, page, KVH, D, generator=g).bfloat16()
    return kp, vp, torch.randperm(pages * page, generator=g)


def prefill_rows(o, lengths: list[int], reps: int, g: torch.Generator) -> list[dict[str, Any]]:
    rows, h, scale = [], KVH * G, D**-0.5
    for n in lengths:
        kp, vp, perm = _pool(n, g)
        slots = perm[:n]
        q = torch.randn(n, h, D, generator=g).bfloat16()
        qf = q.float()
        r = max(2, reps if n <= 2048 else reps // 2)
        times = {"bf16": [], "widen": []}
        for _ in range(2):  # alternating halves
            times["bf16"].append(timed(lambda: o.prefill_attention_paged(
                q, kp, vp, slots, scale, 1.0, 1.0, KVH), r))
            times["widen"].append(timed(lambda: o.prefill_attention_paged(
                qf, kp, vp, slots, scale, 1.0, 1.0, KVH), r))
        tb, tw = min(times["bf16"]), min(times["widen"])
        flops = 4 * h * D * n * (n + 1) / 2
        row = {"kind": "prefill", "n": n, "bf16_ms": tb * 1e3, "widen_ms": tw * 1e3,
               "speedup": tw / tb, "bf16_gflops": flops / tb / 1e9,
               "widen_gflops": flops / tw / 1e9}
        rows.append(row)
        print(f"  prefill n={n:5d}: bf16 {tb * 1e3:8.2f} ms ({row['bf16_gflops']:.0f} GF/s), "
              f"widen {tw * 1e3:8.2f} ms ({row['widen_gflops']:.0f} GF/s), x{tw / tb:.2f}",
              flush=True)
    return rows


def decode_rows(o, shapes: list[tuple[int, int]], reps: int, g: torch.Generator
                ) -> list[dict[str, Any]]:
    rows, scale = [], D**-0.5
    for b, ctx in shapes:
        kp, vp, perm = _pool(b * ctx, g)
        table = perm[: b * ctx].contiguous()
        q = torch.randn(b, KVH, G, D, generator=g).bfloat16()
        qf = q.float()
        times = {"bf16": [], "widen": []}
        for _ in range(2):
            times["bf16"].append(timed(lambda: o.decode_attention_paged(
                q, kp, vp, table, None, scale), reps))
            times["widen"].append(timed(lambda: o.decode_attention_paged(
                qf, kp, vp, table, None, scale), reps))
        tb, tw = min(times["bf16"]), min(times["widen"])
        row = {"kind": "decode", "batch": b, "ctx": ctx, "bf16_ms": tb * 1e3,
               "widen_ms": tw * 1e3, "speedup": tw / tb}
        rows.append(row)
        print(f"  decode b={b} ctx={ctx:5d}: bf16 {tb * 1e3:7.3f} ms, widen {tw * 1e3:7.3f} ms, "
              f"x{tw / tb:.2f}", flush=True)
    return rows


def engine_rows(n: int, rounds: int) -> dict[str, Any]:
    """SmolLM2 bf16 (/work/smollm2-hf) in this process: one n-token prefill's wall time with
    the engine's prefill attention in the bf16 order (as served) and in the widening order (its
    queries handed over as float32), runs alternating, fresh tokens each run."""
    import random
    import time

    from pdcore.config import ServerArgs
    from pdcore.engine.model import llama
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    real, widen = llama._native_for, {"on": False}

    def routed(name: str, q: torch.Tensor):  # type: ignore[no-untyped-def]
        fn = real(name, q)
        if fn is None or name != "prefill_attention_paged":
            return fn

        def run(q, kp, vp, slots, scale, ks, vs, kvh, out=None):  # type: ignore
            if not widen["on"]:
                return fn(q, kp, vp, slots, scale, ks, vs, kvh, out)
            o = fn(q.float(), kp, vp, slots, scale, ks, vs, kvh)
            return out.copy_(o) if out is not None else o.to(q.dtype)
        return run

    llama._native_for = routed
    eng = LLMEngine(ServerArgs(model_path="/work/smollm2-hf", max_total_tokens=n + 512,
                               dtype="bfloat16", log_level="warning"))
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    rnd = random.Random(0)
    times: dict[str, list[float]] = {"bf16": [], "widen": []}
    try:
        eng.generate([[rnd.randrange(100, 40000) for _ in range(64)]], sp)
        for r in range(rounds):
            for order in (("bf16", "widen") if r % 2 == 0 else ("widen", "bf16")):
                widen["on"] = order == "widen"
                p = [[rnd.randrange(100, 40000) for _ in range(n)]]
                t = time.perf_counter()
                eng.generate(p, sp)
                times[order].append(time.perf_counter() - t)
    finally:
        llama._native_for = real
        eng.close()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"  engine prefill n={n}: bf16 {med['bf16']:.3f} s, widen {med['widen']:.3f} s, "
          f"x{med['widen'] / med['bf16']:.3f}", flush=True)
    return {"kind": "engine_prefill", "n": n, "prefill_s": times, "median_s": med,
            "speedup": med["widen"] / med["bf16"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--decode", default="1x4096,4x4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--suffix", default="")
    ap.add_argument("--engine", type=int, default=0,
                    help="also an in-engine prefill A/B of this many tokens (SmolLM2 bf16)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from pdcore.engine import native

    o = native.ops()
    if o is None or not native.bf16_gemm():
        raise SystemExit(f"needs the native kernels with vdpbf16ps: {native.status()}")
    torch.set_num_threads(args.threads)
    run = Run(f"bf16_attention{args.suffix}", vars(args))
    g = torch.Generator().manual_seed(0)
    rows = prefill_rows(o, [int(x) for x in args.lengths.split(",")], args.reps, g)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.decode.split(",") if s]
    rows += decode_rows(o, shapes, args.reps * 4, g)
    engine = engine_rows(args.engine, args.rounds) if args.engine else None
    note = load_note(run)
    fig, axes = figure(1, width=8.0)
    ax = axes[0]
    labels = [f"prefill {r['n']}" if r["kind"] == "prefill" else f"decode {r['batch']}x{r['ctx']}"
              for r in rows]
    for off, key, color in ((-0.2, "widen_ms", "#888"), (0.2, "bf16_ms", "#3a7")):
        ax.bar([i + off for i in range(len(rows))], [r[key] / r["widen_ms"] for r in rows], 0.4,
               label=key.replace("_ms", ""), color=color)
    for i, r in enumerate(rows):
        ax.text(i, 1.0, f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("time / widening order's")
    ax.set_title(f"bf16 attention, vdpbf16ps vs widened ({args.threads} threads; {note})",
                 fontsize=9)
    ax.legend()
    save_figure(fig, f"bf16_attention{args.suffix}")
    path = run.finish({"rows": rows, "engine": engine, "note": note})
    print(f"wrote {path} ({note})")


if __name__ == "__main__":
    main()
