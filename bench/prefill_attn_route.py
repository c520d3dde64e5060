"""A bf16 prefill chunk's attention on a CPU with AMX: the native causal kernel against torch's
SDPA (its CPU flash attention, AMX tiles through oneDNN's brgemm), the two routes
PDCORE_PREFILL_ATTENTION chooses between (engine/model/prefill_route.py, #47).

Two parts (`--parts`, both by default):
- `kernel`: one layer's attention, bf16, two threads, for the 1B-shaped model's heads (32 query
  / 8 KV heads of 64) and SmolLM2-135M's (9 / 3 of 64): a whole prompt of n tokens (`whole`:
  native reads a bf16 pool in place at scattered slots; SDPA takes the chunk's own K/V, as
  Attention.forward does) and a chunk of n after a prefix of p (`chunk`: SDPA gathers the
  prefix and merges two flash passes, `_after_prefix`). Median wall clock of `--reps`.
- `engine`: SmolLM2 bf16 in this process (LLMEngine), one prompt of n fresh tokens prefilled
  (max_new_tokens 1), the route switched between runs on the loaded model (`sdpa_from` of
  every layer: the chooser's auto value against never), runs alternating.

Writes bench/results/prefill_attn_route.json and .png. A timing run:
`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/prefill_attn_route.py`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import Run, bar_groups, figure, load_note, prefill_timer, save_figure, timed

NAME = "prefill_attn_route"
SHAPES = {"1b": (8, 4, 64), "smollm2": (3, 3, 64)}  # KV heads, query heads per KV head, dim


def kernel_part(cases: list[tuple[int, int]], shapes: list[str], reps: int) -> list[dict]:
    from pdcore.engine import native
    from pdcore.engine.model.llama import _after_prefix

    o = native.ops()
    if o is None:
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    g = torch.Generator().manual_seed(0)
    dt, rows = torch.bfloat16, []
    for shape in shapes:
        kvh, grp, d = SHAPES[shape]
        h, scale = kvh * grp, d**-0.5
        for p, n in cases:
            ctx, page = p + n, 16
            pages = ctx // page + 4
            kp = torch.randn(pages, page, kvh, d, generator=g).to(dt)
            vp = torch.randn(pages, page, kvh, d, generator=g).to(dt)
            kf, vf = kp.view(-1, kvh, d), vp.view(-1, kvh, d)
            slots = torch.randperm(pages * page, generator=g)[:ctx]
            q = torch.randn(n, h, d, generator=g).to(dt)
            out = torch.empty_like(q)
            # the chunk's own K/V as this step computed them (rows of the pool's copy)
            kc, vc = kf[slots[p:]].transpose(0, 1), vf[slots[p:]].transpose(0, 1)

            def nat() -> None:
                o.prefill_attention_paged(q, kf, vf, slots, scale, 1.0, 1.0, kvh, out)

            if p == 0:
                def sdpa() -> torch.Tensor:
                    return F.scaled_dot_product_attention(
                        q.transpose(0, 1)[None], kc[None], vc[None], is_causal=True,
                        scale=scale, enable_gqa=True)[0]
            else:
                def sdpa() -> torch.Tensor:
                    pre = slots[:p]
                    kpre = kf.index_select(0, pre).transpose(0, 1)
                    vpre = vf.index_select(0, pre).transpose(0, 1)
                    return _after_prefix(q.transpose(0, 1), kpre, vpre, kc, vc, scale)

            nat()
            err = (out.float().transpose(0, 1) - sdpa().float()).abs().max().item()
            r = reps if ctx <= 2048 else max(2, reps // 2)
            tn, ts = timed(nat, r), timed(sdpa, r)
            row = {"shape": shape, "prefix": p, "n": n, "native_ms": tn * 1e3,
                   "sdpa_ms": ts * 1e3, "sdpa_speedup": tn / ts, "max_abs_diff": err}
            rows.append(row)
            print(f"  {shape:7s} prefix {p:5d} n {n:5d}: native {tn * 1e3:9.2f} ms, sdpa "
                  f"{ts * 1e3:9.2f} ms, sdpa x{tn / ts:.2f} faster, diff {err:.1e}", flush=True)
    return rows


def engine_part(lengths: list[int], rounds: int, model_path: str) -> list[dict]:
    from pdcore.config import ServerArgs
    from pdcore.engine.model import prefill_route
    from pdcore.runtime.llm_engine import LLMEngine

    rng = random.Random(0)
    eng = LLMEngine(ServerArgs(model_path=model_path, dtype="bfloat16",
                               max_total_tokens=max(lengths) + 2048, log_level="warning"))
    model = eng.loop.runner.model
    attns = [la.self_attn for la in model.layers]
    auto = prefill_route.choose(torch.bfloat16, "cpu", mode="auto").sdpa_from
    rows = []
    prefill = prefill_timer(eng, rng)

    try:
        prefill(64)
        for rnd in range(rounds):
            for n in lengths:
                for route in (("auto", "native") if rnd % 2 == 0 else ("native", "auto")):
                    for a in attns:
                        a.sdpa_from = auto if route == "auto" else prefill_route.NEVER
                    before = model.native_prefill_chunks
                    t = prefill(n)
                    took = model.native_prefill_chunks - before
                    rows.append({"round": rnd, "n": n, "route": route, "s": t,
                                 "native_chunks": took})
                    print(f"  round {rnd} n={n:5d} {route:6s}: {t:.3f} s (native chunks "
                          f"{took})", flush=True)
    finally:
        eng.close()
    summary = []
    for n in lengths:
        a = statistics.median(r["s"] for r in rows if r["n"] == n and r["route"] == "auto")
        b = statistics.median(r["s"] for r in rows if r["n"] == n and r["route"] == "native")
        summary.append({"n": n, "auto_s": a, "native_s": b, "auto_speedup": b / a})
        print(f"  prefill n={n}: auto {a:.3f} s, native {b:.3f} s, auto x{b / a:.2f} faster")
    return rows + [{"summary": summary, "auto_sdpa_from": auto}]


def plot(data: dict[str, Any], out: Path | None) -> None:
    kr = data.get("kernel", [])
    if not kr:
        return
    fig, axes = figure(1, width=9)
    labels = [f"{r['shape']} {'p' + str(r['prefix']) + '+' if r['prefix'] else ''}{r['n']}"
              for r in kr]
    bar_groups(axes[0], labels, {"native": [r["native_ms"] for r in kr],
                                    "sdpa": [r["sdpa_ms"] for r in kr]},
               "ms per layer (log)", "bf16 prefill attention, one layer, 2 threads")
    axes[0].set_yscale("log")
    for t in axes[0].get_xticklabels():
        t.set_rotation(45)
    save_figure(fig, NAME, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="kernel,engine")
    ap.add_argument("--cases", default="0:64,0:128,0:256,0:512,0:1024,0:4096,4096:1024,4096:256",
                    help="kernel part: prefix:n pairs")
    ap.add_argument("--shapes", default="1b,smollm2")
    ap.add_argument("--lengths", default="4096", help="engine part: prompt lengths")
    ap.add_argument("--model-path", default="/work/smollm2-hf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="engine part: A/B rounds")
    ap.add_argument("--out", default="", help="result folder (default bench/results)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    run = Run(NAME, vars(args))
    out = Path(args.out) if args.out else None
    data: dict[str, Any] = {}
    if "kernel" in parts:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
        data["kernel"] = kernel_part(cases, args.shapes.split(","), args.reps)  # type: ignore
    if "engine" in parts:
        data["engine"] = engine_part([int(x) for x in args.lengths.split(",")], args.rounds,
                                     args.model_path)
    data["note"] = load_note(run)
    path = run.finish(data, out)
    plot(data, out)
    print(f"wrote {path} ({data['note']})")


if __name__ == "__main__":
    main()
