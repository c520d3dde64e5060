"""Where the 1B-shaped model's 16k-token prefill goes (#47: 16384 in / 128 out at c1), one
layer measured and scaled to the prompt: the native causal prefill attention
(prefill_attention_paged) of every chunk of a 16384-token prompt at each chunk size, its
GFLOP/s (the causal half counted: 4 H d per visible key and query), against the float32
GEMMs of a layer (the 1B shapes: q, k, v, o, gate, up, down) for the same tokens in each
layout the loader chooses between (torch's linear, oneDNN's packed weight, the native panels),
and the FMA peak these rates imply. Wall clock at `--threads`; the pool float32,
slots in one run.

Writes bench/results/prefill_16k_profile[_<tag>].json. Run as a timing run:
`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/prefill_16k_profile.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import Run, load_note

NAME = "prefill_16k_profile"
KVH, G, D, LAYERS = 8, 4, 64, 16  # Llama-3.2-1B's attention
HIDDEN, INTER = 2048, 8192
# (in, out) of a layer's GEMMs: q, k, v, o, gate, up, down
LINEARS = [(HIDDEN, HIDDEN), (HIDDEN, KVH * D), (HIDDEN, KVH * D), (HIDDEN, HIDDEN),
           (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]


def attention(prompt: int, chunk: int) -> dict[str, Any]:
    from pdcore.engine import native

    o = native.ops()
    if o is None:
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    g = torch.Generator().manual_seed(0)
    kp = torch.randn(prompt, KVH, D, generator=g)
    vp = torch.randn(prompt, KVH, D, generator=g)
    table = torch.arange(prompt)
    secs, flops, per_chunk = 0.0, 0.0, []
    for end in range(chunk, prompt + 1, chunk):
        q = torch.randn(chunk, KVH * G, D, generator=g)
        o.prefill_attention_paged(q[:16], kp, vp, table[: end - chunk + 16], D**-0.5, 1.0,
                                  1.0, KVH)  # warm
        t = time.perf_counter()
        o.prefill_attention_paged(q, kp, vp, table[:end], D**-0.5, 1.0, 1.0, KVH)
        dt = time.perf_counter() - t
        f = 4 * KVH * G * D * (chunk * (end - chunk) + chunk * (chunk + 1) / 2)
        secs, flops = secs + dt, flops + f
        per_chunk.append({"ctx": end, "s": dt, "GFLOPs": f / dt / 1e9})
    return {"chunk": chunk, "layer_s": secs, "prompt_s": secs * LAYERS,
            "GFLOPs": flops / secs / 1e9, "per_chunk": per_chunk}


def gemms(tokens: int, reps: int, layout: str = "torch") -> dict[str, Any]:
    """A layer's GEMMs for `tokens` rows: `torch` (F.linear, the plain weight), `onednn`
    (oneDNN's packed weight) or `panels` (the native panel GEMM, gemm.h), the layouts
    models/layers.py chooses between at load; best of `reps`."""
    from pdcore.engine.model import layers

    g = torch.Generator().manual_seed(1)
    x = {i: torch.randn(tokens, i, generator=g) for i in {a for a, _ in LINEARS}}
    ws = [torch.randn(o, i, generator=g) for i, o in LINEARS]
    packed = [None if layout == "torch" else layers._onednn(w) if layout == "onednn"
              else layers.pack_panels(w) for w in ws]

    def layer() -> None:
        for w, p, (i, _) in zip(ws, packed, LINEARS):
            layers.linear(x[i], w, None, p)

    layer()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        layer()
        best = min(best, time.perf_counter() - t)
    f = sum(2 * tokens * i * o for i, o in LINEARS)
    return {"tokens": tokens, "layout": layout, "layer_s": best, "GFLOPs": f / best / 1e9,
            "flops_per_token_layer": f / tokens}


def plot(data: dict[str, Any], path: Path) -> None:
    """The prompt's seconds (16 layers) of the attention at each chunk size and of the GEMMs in
    each layout and row count, with their GFLOP/s, beside the JSON."""
    from common import figure

    bars = [(f"attn c{a['chunk']}", a["prompt_s"], a["GFLOPs"]) for a in data["attention"]]
    bars += [(f"{g['layout']} {g['tokens']}", g["prompt_s"], g["GFLOPs"])
             for g in data.get("gemm_layouts", [])]
    fig, (ax,) = figure(1, width=9)
    ax.bar(range(len(bars)), [b[1] for b in bars])
    for i, b in enumerate(bars):
        ax.text(i, b[1], f"{b[2]:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, fontsize=8)
    ax.set_ylabel("s for a 16k prompt (16 layers); GFLOP/s above")
    ax.set_title("16k prefill: attention by chunk size, GEMMs by layout and rows")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--chunks", default="2048,4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gemm-rows", default="2048")
    ap.add_argument("--layouts", default="torch,onednn,panels")
    ap.add_argument("--tag", default="", help="suffix of the JSON's name (a session: s10)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = Run(NAME + (f"_{args.tag}" if args.tag else ""), vars(args))
    data: dict[str, Any] = {"attention": [], "gemm": None}
    for c in (int(x) for x in args.chunks.split(",")):
        row = attention(args.prompt, c)
        data["attention"].append(row)
        print(f"attention, chunks of {c}: {row['layer_s']:.2f} s a layer, "
              f"{row['prompt_s']:.1f} s the prompt ({LAYERS} layers), "
              f"{row['GFLOPs']:.0f} GFLOP/s", flush=True)
    data["gemm_layouts"] = []
    for rows in (int(x) for x in args.gemm_rows.split(",")):
        for layout in args.layouts.split(","):
            gm = gemms(rows, args.reps, layout)
            gm["prompt_s"] = gm["layer_s"] * LAYERS * args.prompt / rows
            data["gemm_layouts"].append(gm)
            print(f"GEMMs ({layout}, {rows} tokens): {gm['layer_s']:.2f} s a layer, "
                  f"{gm['GFLOPs']:.0f} GFLOP/s; the prompt: {gm['prompt_s']:.1f} s", flush=True)
    data["gemm"] = data["gemm_layouts"][0]
    data["load"] = load_note(run)
    path = run.finish(data)
    plot(data, path)
    print(f"{data['load']}; wrote {path}")


if __name__ == "__main__":
    main()
