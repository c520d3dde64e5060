"""FP8 K/V pools in the paged decode kernel (#48, s13; engine/native/fp8_load.h): one layer's
decode attention, batch x context, over an FP8 pool (e4m3, k_scale 0.37, v_scale 1.9), side by
side in one process and library:
- gather: what an FP8 model without a decode view ran before (llama.py: the context's rows
  gathered out of the pool, de-quantized to float32, then the view's kernel over them);
- view: the view's kernel over float32 copies already in place (a decode view's steady step,
  its appends not counted);
- fp8: the paged kernel reading the FP8 pool in place (widened and scaled as it loads);
- bf16 / f32: the paged kernel over bf16 / float32 pools of the same values (bytes: 2x / 4x).
bench/engine_profile.py takes no KV dtype (no --kv-cache-dtype), hence this kernel-level run.
Median of --reps after a warm-up, two alternating rounds, the best round. Writes
bench/results/fp8_decode<suffix>.json and .png. Timing run: under the quiet lock
(`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/fp8_decode.py --suffix _s13`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, figure, load_note, save_figure, timed

SHAPES = {"smollm2": (3, 3, 64), "llama1b": (8, 4, 64)}  # KV heads, group, head_dim
KS, VS = 0.37, 1.9
WAYS = ("gather", "view", "fp8", "bf16", "f32")


def rows_for(o, name: str, b: int, ctx: int, reps: int, g: torch.Generator) -> dict[str, Any]:
    kvh, grp, d = SHAPES[name]
    page = 16
    pages = b * ctx // page + 4
    big = torch.finfo(torch.float8_e4m3fn).max
    k8 = (torch.randn(pages, page, kvh, d, generator=g) / KS).clamp(-big, big).to(
        torch.float8_e4m3fn)
    v8 = (torch.randn(pages, page, kvh, d, generator=g) / VS).clamp(-big, big).to(
        torch.float8_e4m3fn)
    kf, vf = k8.float() * KS, v8.float() * VS  # pf_widen's values
    table = torch.randperm(pages * page, generator=g)[: b * ctx].contiguous()
    q = torch.randn(b, kvh, grp, d, generator=g)
    scale = d**-0.5
    flat8 = (k8.view(-1, kvh, d), v8.view(-1, kvh, d))
    shape = (b, ctx, kvh, d)
    kview = kf.view(-1, kvh, d).index_select(0, table).view(shape).transpose(1, 2).contiguous()
    vview = vf.view(-1, kvh, d).index_select(0, table).view(shape).transpose(1, 2).contiguous()
    kb16, vb16 = kf.bfloat16(), vf.bfloat16()

    def gather():  # type: ignore[no-untyped-def]
        kb = flat8[0].index_select(0, table).view(shape).transpose(1, 2).float() * KS
        vb = flat8[1].index_select(0, table).view(shape).transpose(1, 2).float() * VS
        return o.decode_attention(q, kb, vb, None, scale)

    fns = {"gather": gather,
           "view": lambda: o.decode_attention(q, kview, vview, None, scale),
           "fp8": lambda: o.decode_attention_paged(q, k8, v8, table, None, scale, KS, VS),
           "bf16": lambda: o.decode_attention_paged(q, kb16, vb16, table, None, scale),
           "f32": lambda: o.decode_attention_paged(q, kf, vf, table, None, scale)}
    assert torch.equal(fns["fp8"](), fns["gather"]()) and torch.equal(fns["fp8"](), fns["view"]())
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(2):
        for w in (WAYS if r == 0 else WAYS[::-1]):
            times[w].append(timed(fns[w], reps))
    best = {w: min(t) * 1e3 for w, t in times.items()}
    row = {"shape": name, "batch": b, "ctx": ctx, "ms": best, "rounds_ms":
           {w: [x * 1e3 for x in t] for w, t in times.items()},
           "fp8_vs_gather": best["gather"] / best["fp8"], "fp8_vs_view": best["view"] / best["fp8"]}
    print(f"  {name} b={b} ctx={ctx}: " + ", ".join(f"{w} {best[w]:.3f} ms" for w in WAYS)
          + f"; fp8 x{row['fp8_vs_gather']:.2f} vs gather, x{row['fp8_vs_view']:.2f} vs view",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2:4x4096,llama1b:4x4096,smollm2:1x4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()
    from pdcore.engine import native

    o = native.ops()
    if o is None:
        raise SystemExit(f"needs the native kernels: {native.status()}")
    torch.set_num_threads(args.threads)
    run = Run(f"fp8_decode{args.suffix}", {**vars(args), "isa": native.isa()})
    g = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.shapes.split(","):
        name, bc = spec.split(":")
        b, ctx = (int(x) for x in bc.split("x"))
        rows.append(rows_for(o, name, b, ctx, args.reps, g))
    note = load_note(run)
    fig, axes = figure(1, width=9.0)
    ax = axes[0]
    wdt = 0.16
    for j, w in enumerate(WAYS):
        ax.bar([i + (j - 2) * wdt for i in range(len(rows))], [r["ms"][w] for r in rows], wdt,
               label=w)
    ax.set_xticks(range(len(rows)), [f"{r['shape']} {r['batch']}x{r['ctx']}" for r in rows])
    ax.set_ylabel("ms (one layer's decode attention)")
    ax.set_title(f"FP8 pool decode attention ({args.threads} threads; {note})", fontsize=9)
    ax.legend()
    save_figure(fig, f"fp8_decode{args.suffix}")
    path = run.finish({"rows": rows, "note": note})
    print(f"wrote {path} ({note})")


if __name__ == "__main__":
    main()
